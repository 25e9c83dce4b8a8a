"""Checkpoints: CPU tensors, plain model keys (no `module.`/`_orig_mod.` prefixes), atomic
writes, weights_only loading; everything needed to continue exactly, RNG states included.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.nn as nn

from app.models.saved_weights import CHECKPOINT_FORMAT as FORMAT
from app.runtime.errors import UserError, first_line
from app.runtime.files import atomic_path, fsync_folder, remove_temporaries
from app.runtime.moments import moment


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under DistributedDataParallel and/or torch.compile wrappers."""
    while True:
        if hasattr(model, "module"):  # DDP
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        else:
            return model


def to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def rng_states(device: torch.device | str = "cpu") -> dict[str, Any]:
    """This process's generators: Python, numpy, torch's CPU one and, on a GPU worker, the
    generator of its own device only (a state per GPU of the machine would not fit a machine
    with fewer GPUs, and the other GPUs' generators belong to other workers)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {"python": random.getstate(),
              "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
              "torch": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, Any], device: torch.device | str = "cpu") -> None:
    random.setstate(_as_tuples(states["python"]))
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    cuda = cuda_rng_state(states, device)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def cuda_rng_state(states: dict[str, Any], device: torch.device | str) -> torch.Tensor | None:
    """The saved generator state for `device`, if it is a GPU and one was saved. Checkpoints of
    earlier versions hold a list with one state per GPU: this device's, or the first."""
    device = torch.device(device)
    saved = states.get("cuda")
    if device.type != "cuda" or saved is None:
        return None
    if isinstance(saved, (list, tuple)):
        index = device.index or 0
        return saved[index] if index < len(saved) else saved[0]
    return saved


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def save(path: str | Path, payload: dict[str, Any]) -> None:
    """Write durably and atomically (temporary file, fsync, rename, fsync the folder): a crash
    at any point leaves either the old or the new checkpoint, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, durable=True) as temporary:
        torch.save({"format": FORMAT, **to_cpu(payload)}, temporary)


def _point(name: Path, target: Path) -> None:
    """Make `name` another name of `target`, atomically (a hard link renamed into place;
    a copy where the filesystem has no hard links)."""
    with atomic_path(name) as temporary:
        try:
            os.link(target, temporary)
        except OSError:
            shutil.copyfile(target, temporary)


class CheckpointFolder:
    """runs/<run>/checkpoints: step-<N>.pt for the last `keep` saves, last.pt and best.pt as
    further names of one of them, every file complete at all times. `announce(step file, its
    pointers)` hears of each save once it is on disk (the upload process of a bucket's run)."""

    def __init__(self, folder: str | Path, keep: int,
                 announce: Callable[[Path, Iterable[Path]], None] | None = None):
        self.folder = Path(folder)
        self.keep = max(1, keep)
        self.announce = announce

    def save(self, payload: dict[str, Any], step: int, best: bool = False) -> Path:
        """Returns the path of the new step-<N>.pt (last.pt now names it too)."""
        path = self.folder / f"step-{step:09d}.pt"
        save(path, payload)
        pointers = [self.folder / "last.pt", *([self.folder / "best.pt"] if best else [])]
        for pointer in pointers:
            _point(pointer, path)
        # Oldest first by time, not by step: a run resumed from an earlier checkpoint writes
        # lower step numbers that are still the newest files.
        saved = sorted(self.folder.glob("step-*.pt"), key=lambda p: p.stat().st_mtime_ns)
        for old in saved[:-self.keep]:
            old.unlink(missing_ok=True)  # last.pt and best.pt keep their data alive
        fsync_folder(self.folder)
        if self.announce:  # before the moment: a process held there has said what it saved
            self.announce(path, pointers)
        moment("checkpoint:saved")
        return path

    def remove_stale_temporaries(self) -> list[Path]:
        """Half-written files of processes that were killed while saving."""
        return remove_temporaries(self.folder)


def load(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint with weights_only=True (no arbitrary code runs while loading).
    mmap=True reads tensors lazily: cheap when only the small entries are needed."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; check the --resume path")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError, OSError) as error:
        raise UserError(f"checkpoint {path} is truncated, corrupt or not an imagenet-dp "
                        f"checkpoint ({first_line(error, 120, with_type=True)})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} was not written by imagenet-dp "
                        f"(expected format {FORMAT})")
    return payload


def load_model_weights(model: nn.Module, state: dict[str, torch.Tensor], path: str | Path
                       ) -> None:
    try:
        unwrap(model).load_state_dict(state)
    except RuntimeError as error:
        detail = str(error).strip().splitlines()[1:2] or [""]
        raise UserError(f"checkpoint {path} does not fit this model (different --arch or "
                        f"--classes?): {detail[0].strip()[:160]}") from None

"""Checks before training starts, so a run does not fail hours in: the tables' files exist and
the run folder has room for the checkpoints it will keep (the catalog, the tables and the GPUs
are checked earlier, where they are read).
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from app.catalog.retry import request_errors
from app.catalog.shard_store import ShardStore
from app.catalog.storage import DatasetRoot
from app.data.windows import DEFAULT_WINDOW
from app.runtime.errors import UserError
from app.runtime.files import remove_temporaries
from app.training.job import TrainJob

if TYPE_CHECKING:
    import torch.nn as nn  # the driver runs the checks here without torch

log = logging.getLogger("imagenet_dp")

REMOTE_SAMPLE = 32  # files looked up on an object store (one request each)
# state tensors per parameter (momentum; first and second moments; Lookahead's slow weights)
OPTIMIZER_SLOTS = {"sgd": 1, "adamw": 2, "lars": 1, "lamb": 2, "ranger": 3}


def check(job: TrainJob, saves: bool) -> None:
    """`saves`: this process writes the checkpoints (not so for torchrun's other ranks). The run
    folder itself is checked by writing it (app/launch/run.py write_run_folder)."""
    check_listed_files(job)
    if saves:
        remove_stale_temporaries(job)


def check_room_for_checkpoints(job: TrainJob, model: nn.Module) -> None:
    """Room for keep+2 checkpoints: a save writes the new file before the oldest goes, and
    best.pt may keep one more alive. Checked by the saving worker, which has built the model."""
    folder = Path(job.run_dir)
    free = shutil.disk_usage(folder).free
    keep = job.config.run.keep_checkpoints
    needed = (keep + 2) * checkpoint_bytes(model, job.config.optim.optimizer,
                                           job.config.train.model_ema)
    if needed > free:
        raise UserError(f"{folder}: {_gib(free)} free, but {keep} kept checkpoints need about "
                        f"{_gib(needed)}; free space, choose another --output-dir or lower "
                        "--keep-checkpoints")


def checkpoint_bytes(model: nn.Module, optimizer: str, ema: bool = False) -> int:
    """Estimated size of one checkpoint: the weights and buffers (twice with the EMA's) plus
    the optimizer's state per weight (created only at the first step, hence estimated)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return weights * OPTIMIZER_SLOTS[optimizer] + (weights + buffers) * (2 if ema else 1)


def check_listed_files(job: TrainJob) -> None:
    """Every listed image exists (local: one listing per folder), or a random sample does
    (object stores: a request each). Missing files within --max-bad-fraction are skipped and
    listed like bad images; more stop the run here."""
    listed = pd.concat([listed_files(job.tables.train), listed_files(job.tables.val)],
                       ignore_index=True)
    root = job.root
    if "shard" in job.tables.train:
        check_shards(root, listed)
        return
    if root.is_local:
        checked = listed
        missing = _missing_local(Path(root.root), listed)
    else:
        checked = listed.sample(min(REMOTE_SAMPLE, len(listed)),
                                random_state=job.config.train.seed % 2**32)
        missing = [path for path in checked if not _exists_remote(root, path)]
    if not missing:
        return
    limit = job.config.data.max_bad_fraction
    counted = "" if root.is_local else " of a random sample"
    message = (f"dataset '{root.name}': {len(missing)} of {len(checked)} listed images"
               f"{counted} are missing (first: {root.describe(missing[0])})")
    if len(missing) / len(checked) > limit:
        raise UserError(f"{message}, more than --max-bad-fraction {limit:g}; fix the dataset "
                        "or the tables")
    log.warning("%s; they will be skipped and listed in skipped.tsv", message)


def check_shards(root: DatasetRoot, shards: pd.Series) -> None:
    """Every shard is there, all of them checked (one listing per folder): a missing one
    cannot be skipped (every later sample of the epoch's order would shift). Then the cache."""
    sizes = _shard_sizes(root, shards)
    missing = [shard for shard in shards if shard not in sizes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"dataset '{root.name}': shard {root.describe(missing[0])} is missing"
                        f"{more}; put it back (a partial download? download it again), or "
                        "list only the shards there are (`train_shards` / `val_shards` in the "
                        "entry)")
    check_shard_cache(root, list(sizes.values()))


def check_shard_cache(root: DatasetRoot, sizes: list[int]) -> None:
    """The shard cache never evicts the previous, current and next windows: where those alone
    pass its bound, it grows past it (better a line now than a full disk hours in)."""
    store = ShardStore(root)
    window = root.options.get("window", DEFAULT_WINDOW)
    if store.in_place or not sizes:  # local tars are read where they are
        return
    mean = sum(sizes) / len(sizes)
    needed = min(3 * window * mean, sum(sizes))
    if needed > store.max_bytes:
        log.warning("dataset '%s': 3 windows of %d shards (%s each on average) need about %s "
                    "of shard cache, more than its cache_max_gb = %g: the cache will grow "
                    "past that bound; raise `cache_max_gb` or lower `window` in the entry",
                    root.name, window, _size(mean), _size(needed), store.max_bytes / 2**30)


def listed_files(frame: pd.DataFrame) -> pd.Series:
    """The files a split reads: its images, or the shards that hold its samples (`SHARD#N`)."""
    if "shard" not in frame:
        return frame.path
    return pd.Series(frame.path.str.rsplit("#", n=1).str[0].unique(), dtype=str)


def _missing_local(root: Path, listed: pd.Series) -> list[str]:
    """Listed paths not on disk, with one directory listing per folder instead of one stat
    per file (ImageNet: 1,001 listings instead of 1.33 million lookups)."""
    missing = []
    for folder, names in listed.str.rpartition("/").groupby(0)[2]:
        try:
            present = set(os.listdir(root / folder))
        except (FileNotFoundError, NotADirectoryError):
            present = set()
        missing += [posixpath.join(folder, name) for name in names if name not in present]
    return missing


def _shard_sizes(root: DatasetRoot, shards: pd.Series) -> dict[str, int]:
    """The sizes of the listed shards that are there: one listing per folder (on an object
    store one LIST request per 1,000 names)."""
    sizes = {}
    for folder, names in shards.str.rpartition("/").groupby(0)[2]:
        try:
            listed = root.fs.ls(root.path(folder) if folder else root.root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            listed = []
        found = {posixpath.basename(entry["name"].rstrip("/")): entry["size"] for entry in listed}
        sizes.update({posixpath.join(folder, name): int(found[name])
                      for name in names if name in found})
    return sizes


def _exists_remote(root, path: str) -> bool:
    """An object that cannot even be looked up (after the client's retries) will not be read
    either: it counts as missing."""
    try:
        return root.exists(path)
    except request_errors():
        return False


def remove_stale_temporaries(job: TrainJob) -> None:
    """Half-written checkpoints of a process killed while saving: never loaded, only in the
    way. Only the process that saves removes them."""
    for path in remove_temporaries(job.checkpoint_dir):
        log.warning("removed %s, left by a process killed while saving", path)


def _gib(size: float) -> str:
    return f"{size / 2**30:.1f} GiB"


def _size(size: float) -> str:
    return _gib(size) if size >= 2**30 else f"{size / 2**20:.1f} MiB"

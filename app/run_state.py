"""What a checkpoint holds, and how a run continues from one exactly (mid-epoch included).

The primary writes; every worker contributes, so saving is collective: the replicas' BatchNorm
running statistics and RNG states differ between epoch ends, and the epoch's running sums are
spread over the workers. Data order and augmentation need no saved state beyond
(epoch, epoch_step): they are functions of (seed, epoch, image) (app/data/sampler.py), so the
loader processes hold nothing that matters.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from app import checkpoint
from app.devices import WorkerEnv
from app.errors import UserError
from app.job import TrainJob
from app.optim import restore_scheduler
from app.parallel import GradientSync

if TYPE_CHECKING:
    from app.train import Parts


@dataclass
class Progress:
    epoch: int = 0  # epochs completed
    epoch_step: int = 0  # steps done in the current epoch (non-zero: a mid-epoch checkpoint)
    step: int = 0  # optimizer steps taken
    best_top1: float = -1.0


def save(parts: Parts, job: TrainJob, sync: GradientSync, env: WorkerEnv, progress: Progress,
         top1: float | None = None) -> None:
    """Every worker calls this at the same step; the primary writes step-N.pt, last.pt and,
    when `top1` improves, best.pt."""
    replicas = sync.gather(_to_bytes(replica_state(parts.model)))
    epoch_sums = sync.sum_across_workers(parts.epoch_sums).cpu()
    flush_skipped(parts, job, sync, env)
    if not env.is_primary:
        return
    is_best = top1 is not None and top1 > progress.best_top1
    if is_best:
        progress.best_top1 = top1
    payload = {
        "model": checkpoint.unwrap(parts.model).state_dict(),
        "arch": job.config.model.arch, "num_classes": job.tables.num_classes,
        "optimizer": parts.optimizer.state_dict(), "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler else {},
        **asdict(progress), "epoch_sums": epoch_sums, "replicas": replicas,
        "config": job.config.to_dict(), "run_id": job.run_id}
    checkpoint.CheckpointFolder(job.checkpoint_dir, job.config.run.keep_checkpoints).save(
        payload, progress.step, best=is_best)


def restore(parts: Parts, path: str, progress: Progress, env: WorkerEnv) -> dict:
    """Model, optimizer, schedule position, scaler, progress and this worker's share of the
    epoch sums; returns the checkpoint for restore_replica (after the sync's prepare, which
    makes the replicas identical)."""
    state = checkpoint.load(path)
    checkpoint.load_model_weights(parts.model, state["model"], path)
    parts.optimizer.load_state_dict(state["optimizer"])
    restore_scheduler(parts.scheduler, state["scheduler"])
    if parts.scaler and state["scaler"]:
        parts.scaler.load_state_dict(state["scaler"])
    for key, value in asdict(progress).items():
        setattr(progress, key, state.get(key, value))
    if env.is_primary and "epoch_sums" in state:  # counted once, by one worker
        parts.epoch_sums.copy_(state["epoch_sums"])
    return state


def restore_replica(model: nn.Module, state: dict, env: WorkerEnv) -> None:
    """This worker's own BatchNorm statistics and RNG states, when the checkpoint was written
    by as many workers; otherwise the primary's (the run still continues, not bit-exactly)."""
    replicas = state.get("replicas") or []
    if not replicas:
        return
    mine = _from_bytes(replicas[env.rank] if len(replicas) == env.world_size else replicas[0])
    buffers = dict(checkpoint.unwrap(model).named_buffers())
    with torch.no_grad():
        for name, values in mine["buffers"].items():
            buffers[name].copy_(values)
    checkpoint.set_rng_states(mine["rng"])


def replica_state(model: nn.Module) -> dict:
    return {"buffers": {name: b.detach().cpu().clone() for name, b in
                        checkpoint.unwrap(model).named_buffers() if b.is_floating_point()},
            "rng": checkpoint.rng_states()}


def _to_bytes(value: dict) -> bytes:
    """Plain bytes travel through any GradientSync's gather; weights_only reads them back."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


SKIPPED_COLUMNS = ("epoch", "split", "path", "reason")  # skipped.tsv, read with pandas or csv


def flush_skipped(parts: Parts, job: TrainJob, sync: GradientSync, env: WorkerEnv) -> None:
    """Append every worker's skipped images so far to runs/<run>/skipped.tsv."""
    skipped = sum(sync.gather(parts.skipped), [])
    parts.skipped.clear()
    if env.is_primary and skipped:
        path = Path(job.run_dir) / "skipped.tsv"
        header = [] if path.exists() else [SKIPPED_COLUMNS]
        with open(path, "a", encoding="utf-8") as handle:
            handle.writelines("\t".join(map(str, row)) + "\n" for row in header + skipped)


def check_bad_fraction(metrics: dict, job: TrainJob) -> None:
    """Every worker sees the same epoch totals, so all stop together."""
    bad = metrics["train/skipped"] + metrics["val/skipped"]
    seen = bad + metrics["train/images"] + metrics["val/images"]
    limit = job.config.data.max_bad_fraction
    if seen and bad > limit * seen:
        raise UserError(f"{bad} of {seen} images of epoch {metrics['epoch']} could not be read "
                        f"or decoded ({bad / seen:.2%}, more than --max-bad-fraction "
                        f"{limit:.2%}); they are listed in {Path(job.run_dir) / 'skipped.tsv'}")

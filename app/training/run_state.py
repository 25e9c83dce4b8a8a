"""A worker's state <-> a checkpoint, collective parts included.

Saving is collective: a checkpoint gathers from every worker what differs between them, each
replica's BatchNorm statistics and RNG states ("replica", kept per worker) and the epoch's
running sums (summed). Loading hands each worker its own replica entry, and the summed sums to
the primary only, so they count once. Data order and augmentation need nothing beyond (epoch,
epoch_step): they are functions of (seed, epoch, image). The EMA's weights are identical on
every replica (saved once); its BatchNorm statistics are replica state like the model's.

On another number of workers the checkpoint is read in the run's own layout (batch_layout.py),
with one replica state for all: the mean of the saved BatchNorm statistics (what the next
epoch's end would average) and replica 0's RNG states (every replica's generators draw alike).
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import torch
import torch.nn as nn

from app.parallel.sync import GradientSync
from app.runtime.devices import WorkerEnv
from app.runtime.errors import UserError
from app.runtime.moments import moment
from app.training import batch_layout, checkpoint
from app.training.batch_layout import BatchLayout, Saved
from app.training.ema import ModelEma
from app.training.job import TrainJob

log = logging.getLogger("imagenet_dp")


def save(state: dict, sync: GradientSync, env: WorkerEnv, job: TrainJob, best: bool
         ) -> Path | None:
    """Every worker calls this at the same step; the primary writes step-N.pt and points
    last.pt (and, when `best`, best.pt) at it. Returns that path on the primary."""
    replicas = sync.gather(_to_bytes(state["replica"]))
    epoch_sums = sync.sum_across_workers(state["epoch_sums"]).cpu()
    if not env.is_primary:
        return None
    payload = {**{k: v for k, v in state.items() if k != "replica"},
               "epoch_sums": epoch_sums, "replicas": replicas,
               "arch": job.config.model.arch, "num_classes": job.tables.num_classes,
               # what the class indices mean, for predict and export (no dataset needed)
               "class_names": list(job.tables.wnids),
               "class_words": list(job.tables.descriptions),
               "config": job.config.to_dict(), "run_id": job.run_id,
               "batch": batch_layout.record(job, env.world_size)}
    moment("checkpoint:saving")
    folder = checkpoint.CheckpointFolder(job.checkpoint_dir, job.config.run.keep_checkpoints,
                                         announce=job.uploads.saved if job.uploads else None)
    return folder.save(payload, state["step"], best=best)


def load(job: TrainJob, env: WorkerEnv) -> dict:
    """This worker's state from the job's checkpoint, in this run's batch layout: its own
    replica entry if as many workers wrote it, else one rebuilt alike on every worker."""
    state = checkpoint.load(job.resume_from)
    saved = Saved.of(state)
    replicas = [_from_bytes(entry) for entry in state.pop("replicas", None) or []]
    if len(replicas) == env.world_size:
        state["replica"] = replicas[env.rank]
    elif replicas:
        state["replica"] = {"buffers": mean_buffers([r["buffers"] for r in replicas]),
                            "rng": replicas[0]["rng"]}
    if not env.is_primary:
        state.pop("epoch_sums", None)  # counted once, by the primary
    if not job.config.run.evaluate:  # -e trains no step: any layout evaluates
        continue_in(state, saved, BatchLayout.of(job, env.world_size))
    return state


def mean_buffers(saved: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The replicas' buffers averaged in float64, as the parameter server averages them."""
    return {name: torch.stack([buffers[name].double() for buffers in saved]).mean(0).to(
        values.dtype) for name, values in saved[0].items()}


def continue_in(state: dict, saved: Saved, layout: BatchLayout) -> None:
    """The checkpoint's place in its epoch in `layout`'s optimizer steps, and its LR scaled to
    `layout`'s global batch; guards every way in besides the driver's rule (resumed_layout)."""
    offset, size = saved.image_offset, layout.global_batch
    if offset % size:
        raise UserError(f"the checkpoint is {offset} images into epoch {saved.epoch + 1} "
                        f"(global batch {saved.layout.global_batch}), not a whole number of "
                        f"steps of {size}: resume with its global batch")
    state["epoch_step"] = offset // size
    scale = size / saved.layout.global_batch
    if scale != 1:  # a new global batch, from an epoch's end: the LR is per 256 images
        state["scheduler"]["base_lrs"] = [lr * scale for lr in state["scheduler"]["base_lrs"]]
        for group in state["optimizer"]["param_groups"]:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] *= scale


def replica_buffers(models: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """The floating-point buffers (BatchNorm statistics) that differ between replicas until
    averaged at an epoch's end, of each model under its key prefix ("" and "ema.")."""
    return {prefix + name: buffer.detach().cpu().clone()
            for prefix, model in models.items()
            for name, buffer in model.named_buffers() if buffer.is_floating_point()}


def restore_replica_buffers(models: dict[str, nn.Module], saved: dict[str, torch.Tensor]
                            ) -> None:
    buffers = {prefix + name: buffer for prefix, model in models.items()
               for name, buffer in model.named_buffers()}
    with torch.no_grad():
        for name, values in saved.items():
            if name in buffers:  # an EMA's, saved by a run with --model-ema, resumed without
                buffers[name].copy_(values)


def load_ema(ema: ModelEma, state: dict, path: str, required: bool) -> None:
    """The checkpoint's EMA into `ema`; a checkpoint without one starts it from the weights
    at the next update, unless the EMA is what was asked for (-e --use-ema)."""
    if state.get("ema"):
        ema.load_state_dict(state["ema"])
    elif required:
        raise UserError(f"{path} has no EMA weights (it was trained without --model-ema); "
                        "evaluate it without --use-ema")
    else:
        log.info("%s has no EMA weights: the average starts from the weights", path)


def _to_bytes(value: dict) -> bytes:
    """Plain bytes travel through any GradientSync's gather; weights_only reads them back."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def trained_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's weights in a checkpoint, with its floating-point buffers (BatchNorm
    statistics) averaged over the replicas that wrote it (they differ in one of a stop mid-epoch):
    what every replica agrees on."""
    state = checkpoint.load(path)
    weights = dict(state["model"])
    replicas = [_from_bytes(data)["buffers"] for data in state.get("replicas") or []]
    if replicas:  # the EMA's buffers ("ema.<name>") are no weights of the model
        weights |= {name: values for name, values in mean_buffers(replicas).items()
                    if name in weights}
    return weights

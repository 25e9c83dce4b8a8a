"""The global batch, how a run spreads it over its workers, and the rule for resuming a
checkpoint on another number of workers.

An optimizer step takes one global batch of G images from the epoch's global order, a function
of (seed, epoch) only (app/data/sampler.py): `world_size` x `per_worker` (-b) x `accumulation`
(--accum-steps). Step s takes the images at offsets [s x G, (s + 1) x G), however they are
spread, so with G kept a run on any number of workers continues a checkpoint at the same
optimizer step and at pipeline batch offset / (world_size x per_worker) of its own layout.

The rule (`resumed_layout`), for a checkpoint with global batch G and a run given -b b and
--accum-steps k, resumed on M workers:

1. M x b x k == G: the flags as given.
2. Else, with the checkpoint run's own flags (only the world size changed) and
   --keep-global-batch (the default): G is kept, each worker taking G / M images per step in
   the fewest micro-batches of at most b images; refused when M does not divide G.
3. Else the global batch changes, only from a checkpoint at an epoch's end (the epoch's
   remaining images would not fall into the steps it began with); the LR scales with it and
   the schedule goes on from the same epoch (optim.py restore_scheduler).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from app.runtime.errors import UserError
from app.training.job import TrainJob

log = logging.getLogger("imagenet_dp")


@dataclass(frozen=True)
class BatchLayout:
    world_size: int
    per_worker: int  # images per micro-batch and worker (-b)
    accumulation: int = 1  # micro-batches per optimizer step (--accum-steps)

    @property
    def global_batch(self) -> int:
        return self.world_size * self.per_worker * self.accumulation

    @classmethod
    def of(cls, job: TrainJob, world_size: int) -> "BatchLayout":
        return cls(world_size, job.config.train.batch_size, job.config.train.accum_steps)

    def describe(self) -> str:
        return (f"{self.world_size} x {self.per_worker} x {self.accumulation} = "
                f"{self.global_batch} images")


def requested_batch(job: TrainJob) -> tuple[int, int]:
    """-b and --accum-steps as the user gave them (the config holds what the rule chose)."""
    return job.requested_batch or (job.config.train.batch_size, job.config.train.accum_steps)


def record(job: TrainJob, world_size: int) -> dict:
    """What a checkpoint keeps of the layout that wrote it."""
    layout = BatchLayout.of(job, world_size)
    return {**dataclasses.asdict(layout), "global_batch": layout.global_batch,
            "requested": list(requested_batch(job))}


@dataclass(frozen=True)
class Saved:
    """A checkpoint's layout, the flags its run was given, and its place in its epoch."""
    layout: BatchLayout
    requested: tuple[int, int]
    epoch: int
    epoch_step: int

    @classmethod
    def of(cls, state: dict) -> "Saved":
        """From the checkpoint's record; for checkpoints written before it, from its config
        and its number of replica entries (one per worker)."""
        batch = state.get("batch")
        if batch:
            layout = BatchLayout(batch["world_size"], batch["per_worker"], batch["accumulation"])
            requested = tuple(batch["requested"])
        else:
            train = state.get("config", {}).get("train", {})
            layout = BatchLayout(max(1, len(state.get("replicas") or [])),
                                 train.get("batch_size", 1), train.get("accum_steps", 1))
            requested = (layout.per_worker, layout.accumulation)
        return cls(layout, requested, state["epoch"], state["epoch_step"])

    @property
    def image_offset(self) -> int:
        """Images of the epoch's global order trained on (all steps before the last are
        whole global batches)."""
        return self.epoch_step * self.layout.global_batch


@dataclass(frozen=True)
class Resumed:
    layout: BatchLayout
    note: str  # the line that says what changed; "" when nothing did


def resumed_layout(saved: Saved, requested: tuple[int, int], world_size: int,
                   keep: bool = True) -> Resumed:
    """The layout a resumed run trains with (the rule in this module's docstring)."""
    per_worker, accumulation = requested
    given = BatchLayout(world_size, per_worker, accumulation)
    old, size = saved.layout, saved.layout.global_batch
    if given.global_batch == size:
        return Resumed(given, same_global_batch(given, old))
    if keep and requested == saved.requested:
        if size % world_size:
            raise UserError(not_a_divisor(saved, given))
        chosen = BatchLayout(world_size, *split_per_worker(size // world_size, per_worker))
        return Resumed(chosen, same_global_batch(chosen, old))
    if saved.epoch_step:
        raise UserError(new_batch_mid_epoch(saved, given, keep))
    return Resumed(given, f"global batch {size} -> {given.describe()} from epoch "
                          f"{saved.epoch + 1} on: the LR scales by {given.global_batch}/{size} "
                          "and its schedule goes on from the same epoch, in steps of the new "
                          "batch")


def not_a_divisor(saved: Saved, given: BatchLayout) -> str:
    """The refusal when the run's own flags cannot keep the global batch on this many workers;
    changing the global batch is offered only from a checkpoint at an epoch's end."""
    size, world_size = saved.layout.global_batch, given.world_size
    line = (f"cannot keep the checkpoint's global batch of {size} images on "
            f"{workers(world_size)} ({size} is not a multiple of {world_size}): resume on "
            f"{nearest_world_sizes(saved, world_size)} workers")
    if saved.epoch_step:
        return (f"{line} (the checkpoint is {saved.epoch_step} steps into epoch "
                f"{saved.epoch + 1}; changing the global batch needs a checkpoint written at "
                "an epoch's end)")
    return (f"{line}, or give --no-keep-global-batch to train on with {given.describe()} from "
            f"epoch {saved.epoch + 1} on")


def new_batch_mid_epoch(saved: Saved, given: BatchLayout, keep: bool) -> str:
    """The refusal of a new global batch mid-epoch, with each change to the command that
    keeps the checkpoint's (never the flags that were just given)."""
    size, own = saved.layout.global_batch, saved.requested
    flags = f"-b {given.per_worker} --accum-steps {given.accumulation}"
    asked = flags if keep else f"--no-keep-global-batch with {flags}"
    changes = []
    if (given.per_worker, given.accumulation) != own:
        changes.append(f"give -b {own[0]} --accum-steps {own[1]}")
    if not keep:
        changes.append("drop --no-keep-global-batch")
    if size % given.world_size:
        changes.append(f"resume on {nearest_world_sizes(saved, given.world_size)} workers")
    return (f"{asked} on {workers(given.world_size)} is a global batch of "
            f"{given.global_batch} images, but the checkpoint is {saved.epoch_step} steps into "
            f"epoch {saved.epoch + 1} with {size}: the global batch can change only at an "
            f"epoch's end; {' and '.join(changes)}, or resume from a checkpoint written at an "
            "epoch's end")


def nearest_world_sizes(saved: Saved, world_size: int) -> str:
    return " or ".join(map(str, nearest_divisors(saved.layout.global_batch, world_size)))


def same_global_batch(layout: BatchLayout, saved: BatchLayout) -> str:
    if layout == saved:
        return ""
    return (f"resumed on {workers(layout.world_size)} (saved by {saved.world_size}): per-worker "
            f"batch {layout.per_worker}, accumulation {layout.accumulation}, same global batch "
            "and sample order")


def workers(count: int) -> str:
    return f"{count} worker{'s' if count != 1 else ''}"


def split_per_worker(images: int, largest: int) -> tuple[int, int]:
    """(per-worker batch, accumulation) for `images` per worker and step: the fewest
    micro-batches of equal size, at most `largest` images each."""
    accumulation = next(k for k in range(1, images + 1)
                        if images % k == 0 and images // k <= largest)
    return images // accumulation, accumulation


def nearest_divisors(total: int, near: int) -> list[int]:
    """The world sizes nearest `near` that divide `total`: the one below and the one above."""
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    below = [d for d in divisors if d < near]
    above = [d for d in divisors if d > near]
    return [*below[-1:], *above[:1]]


def resumed_job(job: TrainJob, world_size: int, report: Callable[[str], None] = log.info
                ) -> TrainJob:
    """The job as it continues its checkpoint on `world_size` workers: the config's -b and
    --accum-steps set by the rule, the user's kept beside them (unchanged for a fresh run or -e)."""
    if not job.resume_from or job.config.run.evaluate:
        return job
    from app.training import checkpoint  # noqa: PLC0415 (imports torch: only when resuming)
    saved = Saved.of(checkpoint.load(job.resume_from, mmap=True))
    requested = requested_batch(job)
    resumed = resumed_layout(saved, requested, world_size, job.config.train.keep_global_batch)
    if resumed.note:
        report(resumed.note)
    train = dataclasses.replace(job.config.train, batch_size=resumed.layout.per_worker,
                                accum_steps=resumed.layout.accumulation)
    return dataclasses.replace(job, config=dataclasses.replace(job.config, train=train),
                               requested_batch=requested)

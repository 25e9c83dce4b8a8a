"""The input-pipeline contract: what the trainer needs from whichever decoder feeds it.

A pipeline is built once per split and worker. Per epoch (from a given step, so a resumed run
continues mid-epoch) it yields batches already on the training device, with the images it had
to skip (never dropped silently). Batch membership and each image's crop and flip come from
ShardedBatches and the recipe's plan(), so every implementation yields the same batches for the
same (seed, epoch).

`open` comes before the first training step and takes what the pipeline holds for the whole
run (DALI: decoder buffers on the GPU and in pinned memory), so a shortage ends the run at its
start rather than at the first evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

import pandas as pd
import torch

from app.catalog.storage import DatasetRoot
from app.data.augment import IMAGENET_MEAN, IMAGENET_STD, Recipe
from app.data.sampler import ShardedBatches


@dataclass(frozen=True)
class Skipped:
    """An image that could not be read or decoded, and why."""
    path: str
    reason: str


@dataclass
class DeviceBatch:
    images: torch.Tensor  # (n, 3, S, S) normalised, on the training device, model dtype/format
    labels: torch.Tensor  # (n,) int64 on the training device
    skipped: list[Skipped] = field(default_factory=list)

    def __len__(self) -> int:
        return self.labels.shape[0]  # a shape, known on the host: no device sync


@dataclass(frozen=True)
class InputFormat:
    """What the model wants its inputs to look like: where, in which dtype and memory format,
    normalised by which per-channel statistics (of pixels in [0, 1])."""
    device: torch.device
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD


@dataclass(frozen=True)
class PipelineSpec:
    """Everything a pipeline is built from: one split of one dataset for one worker."""
    root: DatasetRoot
    frame: pd.DataFrame  # [path, label]
    recipe: Recipe
    batches: ShardedBatches  # this worker's batches of each epoch
    workers: int  # CPU processes (or threads) that read and decode
    form: InputFormat


class InputPipeline(Protocol):
    def open(self, epoch: int, start_step: int = 0) -> None:
        """Allocate now, ready to deliver `start_step` of `epoch` first (`epoch` reuses it)."""

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[DeviceBatch]: ...

    def steps_per_epoch(self) -> int: ...

    def close(self, at_once: bool = False) -> None:
        """Stop background processes for good; `at_once` (after a failure): without waiting."""

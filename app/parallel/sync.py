"""The GradientSync interface (app/parallel/__init__.py shows how the loop calls it), LocalSync,
and what every implementation shares: image-weighted steps, buffer averaging, checksums."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch
import torch.nn as nn

from app.parallel.watch import SyncFailure
from app.runtime.private_api import foreach


class GradientSync(Protocol):
    def prepare(self, model: nn.Module, ema: nn.Module | None = None) -> nn.Module:
        """Make replicas identical before the first step; returns the module to train. The
        replica checks also compare `ema`'s parameters (the weights' moving average)."""

    def step(self, weight: int, last: bool = True) -> contextlib.AbstractContextManager[float]:
        """Wraps forward + backward of one micro-batch (`last`: the optimizer step's last, which
        exchanges the gradients); yields the factor to multiply the loss by."""

    def finish_step(self) -> int:
        """Wait until every .grad holds the average over workers (weighted by images);
        returns the total image count (0: nobody had images, skip the step)."""

    def sum_across_workers(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of a small tensor over workers (metrics: counts, not means)."""

    def gather(self, value: Any) -> list[Any]:
        """Every worker's `value` (small, picklable), in rank order."""

    def average_buffers(self, model: nn.Module) -> None:
        """Average floating-point buffers (BatchNorm running statistics) over replicas."""

    def close(self) -> None: ...


class StepImages:
    """The image counts of one optimizer step's micro-batches (gradient accumulation). Each
    micro-batch's mean loss is scaled by its images relative to `unit`, the images of the step's
    first micro-batch that had any: .grad then holds (sum over images) / unit, the size of one
    micro-batch's mean (fp16 loss scaling stays in range), and a single micro-batch has factor 1."""

    def __init__(self):
        self.total = self.unit = 0
        self.open = False  # inside a step: more micro-batches may follow

    def add(self, images: int, last: bool) -> bool:
        """Count a micro-batch; True when it is the step's first."""
        first = not self.open
        if first:
            self.total = self.unit = 0
        self.total += images
        self.unit = self.unit or images
        self.open = not last
        return first

    def relative(self, images: int) -> float:
        return images / self.unit if self.unit else 0.0

    def to_mean(self) -> float:
        """The factor from .grad (sum / unit) to the mean over the step's images."""
        return self.unit / self.total if self.total else 1.0


def scale_grads(params: list[torch.Tensor], factor: float) -> None:
    if factor != 1.0:
        foreach("mul_")([p.grad for p in params if p.grad is not None], factor)


class LocalSync:
    """A single worker: nothing to agree on."""

    def __init__(self):
        self.images = StepImages()
        self.params: list[torch.Tensor] = []

    def prepare(self, model: nn.Module, ema: nn.Module | None = None) -> nn.Module:
        self.params = list(model.parameters())
        return model

    @contextlib.contextmanager
    def step(self, weight: int, last: bool = True) -> Iterator[float]:
        self.images.add(weight, last)
        yield self.images.relative(weight)

    def finish_step(self) -> int:
        scale_grads(self.params, self.images.to_mean())
        return self.images.total

    def sum_across_workers(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def average_buffers(self, model: nn.Module) -> None:
        pass

    def close(self) -> None:
        pass


def average_float_buffers(model: nn.Module, mean: Callable[[torch.Tensor], torch.Tensor]
                          ) -> None:
    """Set the buffers replicas agree on by averaging (running mean/var, not counters) to
    `mean` of them, flattened into one tensor: one exchange for all."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if buffers:
        flat = mean(torch.cat([b.detach().reshape(-1) for b in buffers]))
        for buffer, values in zip(buffers, flat.split([b.numel() for b in buffers])):
            buffer.copy_(values.view_as(buffer))


def checked_parameters(model: nn.Module, ema: nn.Module | None = None
                       ) -> list[tuple[str, torch.Tensor]]:
    """The tensors replicas must hold bit-identically, by name: the model's parameters and
    those of its moving average (`ema.<name>`)."""
    named = list(model.named_parameters())
    if ema is not None:
        named += [(f"ema.{name}", param) for name, param in ema.named_parameters()]
    return named


def weights_checksum(tensors: list[torch.Tensor]) -> np.ndarray:
    """Per-tensor sum and sum of squares in float64: cheap, and any drift shows. A numpy array,
    so it can travel between processes by value."""
    params = [t.detach().double() for t in tensors]
    return torch.stack([torch.stack([p.sum(), p.square().sum()]) for p in params]).cpu().numpy()


def compare_checksums(step: int, checksums: list[np.ndarray], names: list[str]) -> None:
    """Replicas must be bit-identical; name the first parameter where one is not."""
    for rank, checksum in enumerate(checksums):
        differs = np.flatnonzero((checksum != checksums[0]).any(axis=1)).tolist()
        if differs:
            raise SyncFailure(
                f"replicas diverged at step {step}: worker {rank} differs from worker 0 in "
                f"{len(differs)} of {len(names)} parameter tensors (first: {names[differs[0]]})")

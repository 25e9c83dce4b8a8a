"""Gradient accumulation: how an epoch's pipeline batches group into optimizer steps.

Each micro-batch is one pipeline batch, so data order, augmentation and seeds stay the
pipeline's, and K micro-batches on N workers see exactly the images of one step of one worker
with batch K x N x b. The run's position, schedule, logging and save/stop requests count
optimizer steps, and checkpoints are taken only between them, so a resumed epoch restarts its
pipeline at batch epoch_step x K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator, TypeVar

from app.data.pipeline import DeviceBatch, InputPipeline

Batch = TypeVar("Batch")


@dataclass(frozen=True)
class Accumulation:
    micro_batches: int  # K: pipeline batches per optimizer step
    batches_per_epoch: int  # the pipeline's

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch."""
        return math.ceil(self.batches_per_epoch / self.micro_batches)

    def first_batch(self, epoch_step: int) -> int:
        """The pipeline batch where optimizer step `epoch_step` of an epoch begins."""
        return epoch_step * self.micro_batches

    def micro_batches_of(self, batches: Iterable[Batch], epoch_step: int
                         ) -> Iterator[tuple[Batch, int, bool]]:
        """(batch, its index in the optimizer step, whether it is the step's last) for an
        epoch's batches from optimizer step `epoch_step` on."""
        index = self.first_batch(epoch_step)
        for batch in batches:
            micro = index % self.micro_batches
            index += 1
            yield batch, micro, micro == self.micro_batches - 1 or index == self.batches_per_epoch

    def epoch(self, pipeline: InputPipeline, epoch: int, epoch_step: int
              ) -> Iterator[tuple[DeviceBatch, int, bool]]:
        """The pipeline's micro-batches of `epoch` from optimizer step `epoch_step` on."""
        batches = pipeline.epoch(epoch, start_step=self.first_batch(epoch_step))
        return self.micro_batches_of(batches, epoch_step)

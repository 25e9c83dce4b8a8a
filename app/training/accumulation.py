"""Gradient accumulation: how an epoch's pipeline batches group into optimizer steps.

Each micro-batch is one pipeline batch of --batch-size images per worker, so the data order,
the augmentation and every image's seed stay those of the pipeline, and K micro-batches on N
workers see exactly the images of one step of one worker with batch K x N x b. An optimizer
step takes `micro_batches` (K) consecutive pipeline batches; the epoch's last step takes what
is left (fewer when K does not divide the epoch's batches).

The run's position (Position.step, .epoch_step), the LR schedule, the print interval and
save/stop requests all count optimizer steps; checkpoints are taken only between them, so a
resumed epoch restarts its pipeline at batch epoch_step x K. A checkpoint written with another
K or number of workers but the same global batch continues at the same optimizer step
(app/training/batch_layout.py).
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

"""Where a worker's training stands (Position, what a checkpoint records of it) and how its
training ended (Finished, or Stopped on request)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Position:
    epoch: int = 0  # epochs completed
    epoch_step: int = 0  # optimizer steps done in the current epoch (non-zero: mid-epoch)
    step: int = 0  # optimizer steps taken


@dataclass(frozen=True)
class Finished:
    metrics: dict  # the last epoch's metrics (or the evaluation's)


@dataclass(frozen=True)
class Stopped:
    step: int  # stopped on request after this step, with a checkpoint saved


Outcome = Finished | Stopped

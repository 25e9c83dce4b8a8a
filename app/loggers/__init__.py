"""Pluggable run logging: a small protocol (base.py), backends chosen by name, several at once.

Metric records are flat dicts. Keys used by the loop: `epoch`; per print interval `train/loss`,
`train/lr`, `train/images_per_sec`, `progress/epoch_step(s)`, `progress/epoch_time_s`; per
epoch `train/epoch_loss`, `val/top1`, `val/top5`, `val/loss`, `epoch/time_s`, `train/skipped`
(with --model-ema also `val_ema/top1`, `val_ema/top5`, `val_ema/loss`). Only the primary
process (rank 0) builds loggers; the others get a NullLogger. The Python API's loggers are
objects (objects.py), started in the caller's thread, where the primary replica's records are
relayed (relay.py); `history` turns a run's metrics.jsonl into its table of epochs.

Imports only app.runtime and app.config: the loggers receive names and numbers, never the job.
"""

from __future__ import annotations

from typing import Callable

from app.loggers.base import Logger, Loggers, NullLogger, RunInfo
from app.loggers.objects import Console, Jsonl, Notebook, TensorBoard, Wandb, logging_to

__all__ = ["LOGGERS", "Console", "Jsonl", "Logger", "Loggers", "Notebook", "NullLogger",
           "RunInfo", "TensorBoard", "Wandb", "build_loggers", "logging_to", "run_outputs"]


# --loggers' choices (adding one is an entry here and in the config's choices). A backend's
# library is imported only when chosen: a machine may have no wandb or tensorboard.
LOGGERS: dict[str, Callable[[RunInfo], Logger]] = {
    "console": Console().start, "tensorboard": TensorBoard().start, "wandb": Wandb().start}


def build_loggers(run: RunInfo) -> Loggers:
    return Loggers(run_outputs(run) + [LOGGERS[name](run) for name in run.settings.loggers])


def run_outputs(run: RunInfo) -> list[Logger]:
    """metrics.jsonl and curves.png: part of every run's outputs, whatever else logs."""
    from app.loggers.curves import CurvesLogger  # noqa: PLC0415
    from app.loggers.jsonl import JsonlLogger  # noqa: PLC0415
    metrics = run.run_dir / "metrics.jsonl"
    # jsonl first: the curves are drawn from the file it has just appended to.
    return [JsonlLogger(metrics), CurvesLogger(metrics, run.run_dir / "curves.png")]

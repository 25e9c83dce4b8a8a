"""Pluggable run logging: a small protocol, backends chosen by name, several at once.

Metric records are flat dicts. Keys used by the loop: `epoch`; per print interval `train/loss`,
`train/lr`, `train/images_per_sec`, `progress/epoch_step(s)`, `progress/epoch_time_s`; per
epoch `train/epoch_loss`, `val/top1`, `val/top5`, `val/loss`, `epoch/time_s`, `train/skipped`.
Only the primary process (rank 0) builds loggers; the others get a NullLogger.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from app.job import TrainJob


class Logger(Protocol):
    def log_config(self, config: dict[str, Any]) -> None: ...
    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, name: str, kind: str,
                     aliases: tuple[str, ...] = ()) -> None: ...
    def finish(self) -> None: ...


class NullLogger:
    """For workers that are not the primary, and the base of backends that ignore some calls."""

    def log_config(self, config: dict[str, Any]) -> None:
        pass

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def log_artifact(self, path: str | Path, name: str, kind: str,
                     aliases: tuple[str, ...] = ()) -> None:
        pass

    def finish(self) -> None:
        pass


class Loggers(NullLogger):
    """Fan-out to several backends."""

    def __init__(self, backends: list[Logger]):
        self.backends = backends

    def log_config(self, config: dict[str, Any]) -> None:
        for backend in self.backends:
            backend.log_config(config)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        for backend in self.backends:
            backend.log_metrics(step, metrics)

    def log_artifact(self, path: str | Path, name: str, kind: str,
                     aliases: tuple[str, ...] = ()) -> None:
        for backend in self.backends:
            backend.log_artifact(path, name, kind, aliases)

    def finish(self) -> None:
        for backend in self.backends:
            backend.finish()


def _console(job: TrainJob) -> Logger:
    from app.loggers.console import ConsoleLogger  # noqa: PLC0415
    return ConsoleLogger(job.config.train.epochs)


def _wandb(job: TrainJob) -> Logger:
    from app.loggers.wandb_logger import WandbLogger  # noqa: PLC0415 (wandb may be missing)
    return WandbLogger(job)


# The loggers a user chooses with --loggers; adding one is an entry here (and in the config's
# choices). Imported only when chosen: the GPU machines may have no wandb.
LOGGERS: dict[str, Callable[[TrainJob], Logger]] = {"console": _console, "wandb": _wandb}


def build_loggers(job: TrainJob) -> Loggers:
    """metrics.jsonl and curves.png are always written (they are part of every run's
    outputs); the chosen loggers come after them."""
    from app.loggers.curves import CurvesLogger  # noqa: PLC0415
    from app.loggers.jsonl import JsonlLogger  # noqa: PLC0415
    run_dir = Path(job.run_dir)
    # jsonl first: the curves are drawn from the file it has just appended to.
    backends: list[Logger] = [JsonlLogger(run_dir / "metrics.jsonl"),
                              CurvesLogger(run_dir / "metrics.jsonl", run_dir / "curves.png")]
    backends += [LOGGERS[name](job) for name in job.config.logging.loggers]
    return Loggers(backends)

"""Pluggable run logging: a small protocol, backends chosen by name, several at once.

Metric records are flat dicts. Keys used by the loop: `epoch`; per print interval `train/loss`,
`train/lr`, `train/images_per_sec`, `progress/epoch_step(s)`; per epoch `train/epoch_loss`,
`val/top1`, `val/top5`, `val/loss`, `epoch/time_s`, `train/skipped`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from app.errors import UserError


class Logger(Protocol):
    def log_config(self, config: dict[str, Any]) -> None: ...
    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, name: str, kind: str) -> None: ...
    def finish(self) -> None: ...


class NullLogger:
    """For workers that are not the primary: they compute metrics but never report them."""

    def log_config(self, config: dict[str, Any]) -> None:
        pass

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def log_artifact(self, path: str | Path, name: str, kind: str) -> None:
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

    def log_artifact(self, path: str | Path, name: str, kind: str) -> None:
        for backend in self.backends:
            backend.log_artifact(path, name, kind)

    def finish(self) -> None:
        for backend in self.backends:
            backend.finish()


def build_loggers(names: list[str], run_dir: str | Path, epochs: int) -> Loggers:
    """jsonl is always on (metrics.jsonl is part of every run's outputs)."""
    from app.loggers.console import ConsoleLogger  # noqa: PLC0415
    from app.loggers.jsonl import JsonlLogger  # noqa: PLC0415
    factories = {"console": lambda: ConsoleLogger(epochs), "jsonl": lambda: None}
    unknown = [n for n in names if n not in factories]
    if unknown:
        raise UserError(f"unknown logger '{unknown[0]}'; known: {', '.join(factories)}")
    backends: list[Logger] = [JsonlLogger(Path(run_dir) / "metrics.jsonl")]
    backends += [factories[name]() for name in dict.fromkeys(names) if name != "jsonl"]
    return Loggers(backends)

"""The logging protocol, the logger that ignores everything and the fan-out to several
backends. Backends import this module, never the package, so the package imports them without
a cycle."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from app.config import LoggingConfig


@dataclass(frozen=True)
class RunInfo:
    """What the loggers are told of a run: names and numbers, never the training job."""
    name: str
    run_id: str  # stable across resumes: a resumed run continues the same wandb run
    run_dir: Path
    epochs: int
    config: dict[str, Any]  # the resolved config, as config.toml holds it
    settings: LoggingConfig


class Logger(Protocol):
    def log_config(self, config: dict[str, Any]) -> None: ...
    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, name: str, kind: str,
                     aliases: tuple[str, ...] = ()) -> None: ...
    def finish(self) -> None: ...


class NullLogger:
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

"""Loggers as objects, for the Python API: `app.train(..., logger=...)` or
`with app.logging_to(logger):` around the call.

Each object describes a backend and starts it when the run starts (`start(run)`), so it can be
made before the run exists and carried anywhere (it pickles). A list of them fans out; any
object with a `log_metrics(step, metrics)` method is taken as a started logger.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

from app.loggers.base import Logger, Loggers, NullLogger, RunInfo
from app.runtime.errors import UserError


class LoggerSpec(Protocol):
    def start(self, run: RunInfo) -> Logger: ...


@dataclass(frozen=True)
class Console:
    """The driver's console output: a progress bar, a summary line per epoch."""

    def start(self, run: RunInfo) -> Logger:
        from app.loggers.console import ConsoleLogger  # noqa: PLC0415
        return ConsoleLogger(run.epochs)


@dataclass(frozen=True)
class Notebook:
    """In Jupyter: a bar per epoch and the curves redrawn in place, not a scroll of lines."""
    curves: bool = True

    def start(self, run: RunInfo) -> Logger:
        from app.loggers.notebook import NotebookLogger  # noqa: PLC0415
        return NotebookLogger(run.epochs, run.name, self.curves)


@dataclass(frozen=True)
class Jsonl:
    """One more metrics.jsonl at `path` (every run writes its own in the run folder)."""
    path: str

    def start(self, run: RunInfo) -> Logger:
        from app.loggers.jsonl import JsonlLogger  # noqa: PLC0415
        return JsonlLogger(self.path)


@dataclass(frozen=True)
class TensorBoard:
    """TensorBoard event files; empty `log_dir`: the run folder's tensorboard/."""
    log_dir: str = ""

    def start(self, run: RunInfo) -> Logger:
        from app.loggers.tensorboard_logger import FOLDER, TensorBoardLogger  # noqa: PLC0415
        return TensorBoardLogger(self.log_dir or run.run_dir / FOLDER)


@dataclass(frozen=True)
class Wandb:
    """A Weights & Biases run. Empty settings defer to the run's logging settings, then to
    wandb's environment variables; `config` is logged beside the run's resolved config."""
    project: str = ""
    name: str = ""
    config: dict[str, Any] | None = None
    entity: str = ""
    mode: str = ""  # online, offline, disabled
    tags: tuple[str, ...] = ()

    def start(self, run: RunInfo) -> Logger:
        from app.loggers.wandb_logger import WandbLogger  # noqa: PLC0415
        settings = run.settings
        settings = dataclasses.replace(
            settings, wandb_project=self.project or settings.wandb_project,
            wandb_entity=self.entity or settings.wandb_entity,
            wandb_mode=self.mode or settings.wandb_mode,
            wandb_tags=list(self.tags) or settings.wandb_tags)
        return WandbLogger(dataclasses.replace(run, name=self.name or run.name, settings=settings,
                                               config={**run.config, **(self.config or {})}))


def in_notebook() -> bool:
    """True inside a Jupyter kernel (not a terminal IPython)."""
    shell = sys.modules.get("IPython")
    shell = shell.get_ipython() if shell else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def default_logger() -> LoggerSpec:
    return Notebook() if in_notebook() else Console()


def start_loggers(logger: Any, run: RunInfo, always: list[Logger] | None = None) -> Loggers:
    """The started backends of `logger` (an object, a list of them, or None: the console, or
    the notebook's), after the `always` ones."""
    chosen = logger if isinstance(logger, (list, tuple)) else [logger]
    backends = list(always or [])
    for item in chosen:
        if hasattr(item, "start"):
            backends.append(item.start(run))
        elif hasattr(item, "log_metrics"):
            backends.append(Partial(item))
        else:
            raise UserError(f"logger={item!r}: pass app.loggers.Console(), Notebook(), Jsonl(), "
                            "TensorBoard(), Wandb(...), a list of them, or an object with "
                            "log_metrics(step, metrics)")
    return Loggers(backends)


class Partial(NullLogger):
    """A caller's logger with only some of the protocol's methods (log_metrics at least)."""

    def __init__(self, logger: Any):
        self.logger = logger

    def __getattribute__(self, name: str) -> Any:
        if name in ("log_config", "log_metrics", "log_artifact", "finish"):
            own = getattr(object.__getattribute__(self, "logger"), name, None)
            if own is not None:
                return own
        return object.__getattribute__(self, name)


_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("imagenet_dp_logger",
                                                               default=None)


@contextlib.contextmanager
def logging_to(logger: Any) -> Iterator[Any]:
    """Every app.train call inside the block logs to `logger` unless it names its own."""
    token = _CURRENT.set(logger)
    try:
        yield logger
    finally:
        _CURRENT.reset(token)


def current_logger() -> Any:
    return _CURRENT.get() or default_logger()

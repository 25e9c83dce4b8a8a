"""TensorBoard backend: event files in the run folder's tensorboard/ (so `tensorboard --logdir
runs` shows every run); every number of a record a scalar under its metrics.jsonl name and
step, the config once as text. tensorboard is imported only when a run asks for it."""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any

from app.loggers.base import NullLogger
from app.loggers.redact import redact
from app.runtime.errors import UserError

FOLDER = "tensorboard"  # inside the run folder


class TensorBoardLogger(NullLogger):
    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
        except ImportError:
            raise UserError("--logger tensorboard: the tensorboard package is not installed "
                            "here; pip install tensorboard, or choose --logger console") from None
        self.writer_class = SummaryWriter
        self.log_dir = str(log_dir)
        self.writer = None  # opened by the first record: its step is the purge step
        self.first_step = 0
        self.config_text = ""

    def log_config(self, config: dict[str, Any]) -> None:
        self.config_text = config_as_text(config)
        if self.writer is not None:
            self.writer.add_text("config", self.config_text, self.first_step)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        writer = self.writer or self._open(step)
        for name, value in metrics.items():
            if isinstance(value, numbers.Real):
                writer.add_scalar(name, value, step)
            elif isinstance(value, str):
                writer.add_text(name, value, step)
        if "val/top1" in metrics:  # the epoch's record: on disk before the next epoch starts
            writer.flush()

    def _open(self, first_step: int):
        """A resumed run logs again the steps after its checkpoint, into a new event file: the
        purge step tells TensorBoard's readers (the Python one needs it) to drop what earlier
        files hold from there on."""
        self.writer = self.writer_class(self.log_dir, purge_step=first_step)
        self.first_step = first_step
        if self.config_text:  # each session's config at the step it starts from
            self.writer.add_text("config", self.config_text, first_step)
        return self.writer

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()  # flushes


def config_as_text(config: dict[str, Any]) -> str:
    """JSON indented four spaces (a markdown block in TensorBoard's text tab), redacted: event
    files get copied and shared."""
    text = json.dumps(redact(config), indent=2, default=str)
    return "\n".join("    " + line for line in text.splitlines())

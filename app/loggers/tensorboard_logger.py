"""TensorBoard backend: event files in the run folder's tensorboard/ (so `tensorboard --logdir
runs` shows every run), written by torch's SummaryWriter. Every number of a record goes in as
a scalar under its metrics.jsonl name and step; the config goes in once as text.

Created only in the primary process, like every logger. tensorboard is imported here only, when
a run asks for it: the other processes, and the runs that do not ask, never pay for it
(tests/test_imports.py, tests/test_tensorboard.py).
"""

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
        """A resumed run logs again the steps after its checkpoint, into a new event file
        beside the old ones: the purge step tells TensorBoard's readers to drop what earlier
        files hold from the first step this session logs on (the data server drops a series'
        later steps by itself; the Python reader needs the marker)."""
        self.writer = self.writer_class(self.log_dir, purge_step=first_step)
        self.first_step = first_step
        if self.config_text:  # each session's config at the step it starts from
            self.writer.add_text("config", self.config_text, first_step)
        return self.writer

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()  # flushes


def config_as_text(config: dict[str, Any]) -> str:
    """JSON, each line indented four spaces: TensorBoard's text tab renders markdown, where an
    indented block keeps its layout. Redacted as wandb's: event files get copied and shared."""
    text = json.dumps(redact(config), indent=2, default=str)
    return "\n".join("    " + line for line in text.splitlines())

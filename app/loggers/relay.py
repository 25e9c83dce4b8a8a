"""Log records of the primary replica, delivered in the caller's thread.

The Python API's loggers are the caller's objects (a notebook's widgets and figures, a wandb
run): they run where the caller runs, not in a replica thread or a worker process. The primary
replica logs to a RelayLogger, which puts each call on a queue (between threads, or from a
worker process); the caller's thread `deliver`s them while it watches the replicas, and at the end.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

from app.loggers.base import Logger, NullLogger


class RelayLogger(NullLogger):
    def __init__(self, outbox: Any):
        self.outbox = outbox

    def log_config(self, config: dict[str, Any]) -> None:
        self.outbox.put(("log_config", (config,)))

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.outbox.put(("log_metrics", (step, metrics)))

    def log_artifact(self, path: str | Path, name: str, kind: str,
                     aliases: tuple[str, ...] = ()) -> None:
        self.outbox.put(("log_artifact", (str(path), name, kind, aliases)))


def deliver(inbox: Any, logger: Logger) -> None:
    while True:
        try:
            method, args = inbox.get_nowait()
        except queue.Empty:
            return
        getattr(logger, method)(*args)

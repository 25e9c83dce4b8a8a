"""runs/<run>/metrics.jsonl: one JSON object per record, appended and flushed as it comes."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from app.loggers.base import NullLogger


class JsonlLogger(NullLogger):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(self.path, "a", encoding="utf-8")

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": round(time.time(), 3), **metrics}
        # JSON has no NaN/inf: write them as null so every line stays parseable.
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                  for k, v in record.items()}
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def finish(self) -> None:
        self.handle.close()

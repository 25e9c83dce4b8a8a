"""runs/<run>/curves.png, redrawn from metrics.jsonl at the end of every epoch (the file holds
earlier sessions of a resumed run too, which this process never saw)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.loggers.base import NullLogger
from app.loggers.plots import draw_curves, load_metrics


class CurvesLogger(NullLogger):
    def __init__(self, metrics_path: Path, image_path: Path):
        self.metrics_path = metrics_path
        self.image_path = image_path

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        if "val/top1" in metrics:
            draw_curves({self.image_path.parent.name: load_metrics(self.metrics_path)},
                        self.image_path)

"""runs/<run>/curves.png, redrawn from metrics.jsonl at the end of an epoch (the file holds
earlier sessions of a resumed run too, which this process never saw): at most every REDRAW_S,
so that a run of short epochs does not spend its time drawing, and at the run's end."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from app.loggers.base import NullLogger
from app.loggers.plots import draw_curves, load_metrics

REDRAW_S = 60.0  # an ImageNet epoch takes minutes even on 8 GPUs: each of its epochs is drawn


class CurvesLogger(NullLogger):
    def __init__(self, metrics_path: Path, image_path: Path):
        self.metrics_path = metrics_path
        self.image_path = image_path
        self.drawn_at = time.monotonic()  # the run's start: a first epoch under REDRAW_S waits
        self.undrawn = False  # an epoch ended since the last draw

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        if "val/top1" in metrics:
            self.undrawn = True
            if time.monotonic() - self.drawn_at >= REDRAW_S:
                self.draw()

    def finish(self) -> None:
        if self.undrawn:
            self.draw()

    def draw(self) -> None:
        draw_curves({self.image_path.parent.name: load_metrics(self.metrics_path)},
                    self.image_path)
        self.drawn_at, self.undrawn = time.monotonic(), False

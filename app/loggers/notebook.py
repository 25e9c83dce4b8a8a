"""Progress in a Jupyter notebook: the console's bar per epoch as a tqdm.auto bar (a widget
where ipywidgets is installed), its summary line per epoch, and the run's curves redrawn in
place after every epoch (as d2l's Animator)."""

from __future__ import annotations

import io
import sys
from typing import Any

import pandas as pd

from app.loggers.console import ConsoleLogger
from app.loggers.plots import curves_figure


class NotebookLogger(ConsoleLogger):
    def __init__(self, epochs: int, name: str, curves: bool = True):
        super().__init__(epochs, sys.stdout)
        self.interactive = True  # a bar, not lines, whatever the kernel's stdout says
        self.name, self.curves = name, curves
        self.records: list[dict[str, Any]] = []
        self.figure = None  # the display handle the curves are redrawn into

    def make_bar(self, total: int, desc: str):
        from tqdm.auto import tqdm  # noqa: PLC0415 (picks the widget inside Jupyter)
        return tqdm(total=total, desc=desc, unit="step")

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        if "train/loss" in metrics or "val/top1" in metrics:
            self.records.append({"step": step, **metrics})
        super().log_metrics(step, metrics)
        if "val/top1" in metrics and self.curves:
            self._redraw()

    def _redraw(self) -> None:
        """As a PNG: a bare Figure has no notebook formatter until pyplot sets one up."""
        from IPython.display import Image, display  # noqa: PLC0415 (only inside IPython)
        png = io.BytesIO()
        curves_figure({self.name: pd.DataFrame.from_records(self.records)}).savefig(
            png, format="png", dpi=72)
        if self.figure is None:
            self.figure = display(Image(png.getvalue()), display_id=True)
        else:
            self.figure.update(Image(png.getvalue()))

"""Progress in a Jupyter notebook: a tqdm.auto bar per epoch (a widget where ipywidgets is
installed) and the curves of the run so far, redrawn in place after every epoch (d2l's
Animator does the same), with the console's summary line per epoch under them."""

from __future__ import annotations

import io
from typing import Any

import pandas as pd

from app.loggers.base import NullLogger
from app.loggers.console import epoch_summary
from app.loggers.plots import curves_figure


class NotebookLogger(NullLogger):
    def __init__(self, epochs: int, name: str, curves: bool = True):
        from tqdm.auto import tqdm  # noqa: PLC0415 (picks the widget inside Jupyter)
        self.tqdm = tqdm
        self.epochs, self.name, self.curves = epochs, name, curves
        self.bar = None
        self.bar_epoch = None
        self.records: list[dict[str, Any]] = []
        self.figure = None  # the display handle the curves are redrawn into

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        if "train/loss" in metrics:
            self.records.append({"step": step, **metrics})
            self._progress(metrics)
        if "val/top1" in metrics:
            self.records.append({"step": step, **metrics})
            self._close_bar()
            print(epoch_summary(metrics, self.epochs), flush=True)
            if self.curves:
                self._redraw()

    def _progress(self, m: dict[str, Any]) -> None:
        if self.bar is None or self.bar_epoch != m["epoch"]:
            self._close_bar()
            self.bar = self.tqdm(total=m["progress/epoch_steps"], unit="step",
                                 desc=f"epoch {m['epoch']}/{self.epochs}")
            self.bar_epoch = m["epoch"]
        self.bar.update(m["progress/epoch_step"] - self.bar.n)
        self.bar.set_postfix_str(f"loss {m['train/loss']:.4f}  lr {m['train/lr']:.4g}  "
                                 f"{m['train/images_per_sec']:.0f} img/s")

    def _redraw(self) -> None:
        """As a PNG of its own making: a bare Figure has no notebook formatter until pyplot
        has set the inline backend up."""
        from IPython.display import Image, display  # noqa: PLC0415 (only inside IPython)
        png = io.BytesIO()
        curves_figure({self.name: pd.DataFrame.from_records(self.records)}).savefig(
            png, format="png", dpi=72)
        if self.figure is None:
            self.figure = display(Image(png.getvalue()), display_id=True)
        else:
            self.figure.update(Image(png.getvalue()))

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self) -> None:
        self._close_bar()

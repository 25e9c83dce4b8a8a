"""Console output: a progress bar per epoch on a terminal (plain lines when redirected, as
pytorch/examples prints them), with the share of the interval spent waiting for batches, and
one summary line per epoch, with the time the run has left."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

from app.loggers.base import NullLogger


class ConsoleLogger(NullLogger):
    def __init__(self, epochs: int, stream=None):
        self.epochs = epochs
        self.stream = stream or sys.stdout
        self.bar: tqdm | None = None
        self.bar_epoch = None
        self.interactive = self.stream.isatty()

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        if "val/top1" in metrics:
            self._close_bar()
            print(epoch_summary(metrics, self.epochs), file=self.stream, flush=True)
        elif "train/loss" in metrics:
            self._progress(metrics)

    def _progress(self, m: dict[str, Any]) -> None:
        text = (f"loss {m['train/loss']:.4f}  lr {m['train/lr']:.4g}  "
                f"{m['train/images_per_sec']:.0f} img/s")
        if "train/data_wait" in m:  # pytorch/examples' "Data", as a share of the interval
            text += f"  data {m['train/data_wait']:.0%}"
        if not self.interactive:  # tqdm shows the ETA itself; plain lines need it spelled out
            done, total = m["progress/epoch_step"], m["progress/epoch_steps"]
            eta = m["progress/epoch_time_s"] / done * (total - done)
            print(f"epoch {m['epoch']}/{self.epochs} [{done}/{total}]  {text}  "
                  f"eta {tqdm.format_interval(eta)}", file=self.stream, flush=True)
            return
        if self.bar is None or self.bar_epoch != m["epoch"]:
            self._close_bar()
            self.bar = self.make_bar(m["progress/epoch_steps"],
                                     f"epoch {m['epoch']}/{self.epochs}")
            self.bar_epoch = m["epoch"]
        self.bar.update(m["progress/epoch_step"] - self.bar.n)
        self.bar.set_postfix_str(text)

    def make_bar(self, total: int, desc: str):
        return tqdm(total=total, file=self.stream, leave=False, desc=desc, unit="step")

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self) -> None:
        self._close_bar()


def epoch_summary(m: dict[str, Any], epochs: int) -> str:
    parts = [f"epoch {m['epoch']}/{epochs}"]
    if "train/epoch_loss" in m:
        parts.append(f"train loss {m['train/epoch_loss']:.4f}")
    parts.append(f"val top-1 {m['val/top1']:.4f}  top-5 {m['val/top5']:.4f}  "
                 f"loss {m['val/loss']:.4f}")
    if "val_ema/top1" in m:
        parts.append(f"EMA top-1 {m['val_ema/top1']:.4f}  top-5 {m['val_ema/top5']:.4f}")
    if "epoch/time_s" in m:
        parts.append(f"time {m['epoch/time_s']:.1f}s")
    if m.get("run/remaining_s"):  # epochs left x the mean epoch, evaluation included
        parts.append(f"left {tqdm.format_interval(m['run/remaining_s'])}")
    skipped = m.get("train/skipped", 0) + m.get("val/skipped", 0)
    parts.append(f"skipped {skipped} images")
    return "  ".join(parts)

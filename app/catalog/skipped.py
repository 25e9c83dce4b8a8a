"""Images that could not be read or decoded: listed in runs/<run>/skipped.tsv as they are found,
and bounded by --max-bad-fraction. Each worker appends each batch's rows with one write() on a
file opened O_APPEND (kept whole on a local filesystem), so a crash loses or tears no row. A
resumed run may list an image again for the steps it repeats.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Protocol

from app.runtime.errors import UserError
from app.runtime.files import create_if_absent

FILE_NAME = "skipped.tsv"
COLUMNS = ("epoch", "split", "path", "reason")


class SkippedImage(Protocol):
    path: str
    reason: str


def create(run_dir: str | Path) -> None:
    """The file with its header, unless an earlier session of the run made it already."""
    create_if_absent(Path(run_dir) / FILE_NAME, "\t".join(COLUMNS) + "\n")


class SkippedLog:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / FILE_NAME

    def add(self, epoch: int, split: str, images: Iterable[SkippedImage]) -> None:
        rows = "".join(f"{epoch}\t{split}\t{_cell(i.path)}\t{_cell(i.reason)}\n" for i in images)
        if not rows:
            return
        handle = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(handle, rows.encode("utf-8"))
        finally:
            os.close(handle)


def _cell(text: str) -> str:
    """Tabs and line breaks inside a value would shift the columns."""
    return " ".join(str(text).split())


def check_bad_fraction(metrics: dict, limit: float, run_dir: str | Path) -> None:
    """Every worker sees the same epoch totals, so all stop together."""
    bad = metrics["train/skipped"] + metrics["val/skipped"]
    seen = bad + metrics["train/images"] + metrics["val/images"]
    if seen and bad > limit * seen:
        raise UserError(f"{bad} of {seen} images of epoch {metrics['epoch']} could not be read "
                        f"or decoded ({bad / seen:.2%}, more than --max-bad-fraction "
                        f"{limit:.2%}); they are listed in {Path(run_dir) / FILE_NAME}")

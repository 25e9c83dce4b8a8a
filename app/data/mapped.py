"""A dataset's table for loader processes that are not forked: they map it from a file instead
of receiving it through the pipe that starts them.

Forked loader processes share the table's pages with their worker. Spawned ones (DALI's reader
processes always) get their callable pickled: with the columns inside, tens of MB written into
each process's pipe in turn, and a process killed before reading them leaves its parent blocked
in that write for good (Python 3.11 keeps the pipe's other end open in the parent). Pickled
through `mapped`, a column becomes the name of a file, written once by the process that owns it
and mapped read-only by every reader. The files (the temporary folder's imagenet-dp-tables/,
named after their writer) go when their writer ends, or, if it died, with the next writer.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pandas as pd

from app.runtime.liveness import is_alive

SMALL_BYTES = 64 * 1024  # a column this small travels in the pipe as it is
_written: dict[int, tuple[np.ndarray, str]] = {}  # id(column) -> (the column, its file)


class Mapped:
    """Pickles as a call that maps the file read-only in the receiving process."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return np.load, (self.path, "r")


def mapped(column: np.ndarray) -> np.ndarray | Mapped:
    """What to pickle in place of `column` (a numpy array of a table's rows)."""
    if column.nbytes <= SMALL_BYTES or isinstance(column, np.memmap):
        return column
    known = _written.get(id(column))
    if known is None or known[0] is not column:
        known = (column, write(column))
        _written[id(column)] = known
    return Mapped(known[1])


class Rows:
    """A split's image paths and labels by row, pickled through `mapped`."""

    def __init__(self, frame: pd.DataFrame):
        # Fixed-width bytes, not Python strings: forked workers then share these pages
        # instead of copying them as reference counts change.
        self.paths = frame.path.str.encode("utf-8").to_numpy().astype("S")
        self.labels = frame.label.to_numpy()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "paths": mapped(self.paths), "labels": mapped(self.labels)}

    def __len__(self) -> int:
        return len(self.paths)

    def name(self, row: int) -> str:
        return self.paths[row].decode("utf-8")


def folder() -> Path:
    path = Path(tempfile.gettempdir()) / "imagenet-dp-tables"
    path.mkdir(exist_ok=True)
    return path


def write(column: np.ndarray) -> str:
    if not _written:
        remove_orphans()
        atexit.register(remove_own)
    path = folder() / f"{os.getpid()}-{uuid.uuid4().hex}.npy"
    np.save(path, np.ascontiguousarray(column), allow_pickle=False)
    return str(path)


def remove_own() -> None:
    """At exit; a process forked from the owner inherits the list, not the files."""
    for _, path in _written.values():
        if Path(path).name.startswith(f"{os.getpid()}-"):
            with contextlib.suppress(OSError):
                os.unlink(path)
    _written.clear()


def remove_orphans() -> None:
    for path in folder().glob("*.npy"):
        pid = path.name.split("-", 1)[0]
        if pid.isdigit() and not is_alive(int(pid)):
            with contextlib.suppress(OSError):
                path.unlink()

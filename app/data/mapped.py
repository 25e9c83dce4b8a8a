"""A dataset's table, for loader processes that are not forked: they map it from one file
instead of receiving it through the pipe that starts them.

Forked loader processes share the table's pages with their worker (app/data/pillow_pipeline.py).
Processes that are spawned, DALI's reader processes always among them, receive their callable
pickled; with the table's columns inside, that is ~85 MB per process at ImageNet's 1.28M
training images, written into each process's pipe one process after another, and a process
killed before it has read it leaves its parent blocked in that write for good (Python 3.11
keeps the pipe's other end open in the parent). Pickled through `mapped`, a column becomes the
name of a file written once per process that owns it, which every reader maps (read-only,
shared through the page cache): the pipe carries a few hundred bytes.

The files live in the system's temporary folder under imagenet-dp-tables/, named after the
process that wrote them; each is deleted when that process ends, and files of processes that
died without deleting theirs are deleted by the next process that writes one.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
import uuid
from pathlib import Path

import numpy as np

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
    """At exit (a process forked from the owner inherits the list, not the files)."""
    for _, path in _written.values():
        if Path(path).name.startswith(f"{os.getpid()}-"):
            with contextlib.suppress(OSError):
                os.unlink(path)
    _written.clear()


def remove_orphans() -> None:
    """Files of processes that are gone (killed before their exit handlers ran)."""
    for path in folder().glob("*.npy"):
        pid = path.name.split("-", 1)[0]
        if pid.isdigit() and not is_alive(int(pid)):
            with contextlib.suppress(OSError):
                path.unlink()

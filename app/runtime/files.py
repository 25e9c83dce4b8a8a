"""Atomic file writes: readers (and a process killed half-way) see the old file or the new one,
never a torn one."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

TEMPORARY_SUFFIX = ".tmp"  # .<name>.<pid>.tmp beside the target; stale ones are recognisable


def temporary_path(path: Path) -> Path:
    """Where `path` is written before the rename: same folder (a rename never crosses
    filesystems), hidden, named after the writing process so writers never collide."""
    return path.with_name(f".{path.name}.{os.getpid()}{TEMPORARY_SUFFIX}")


def remove_temporaries(folder: Path, pattern: str = f".*{TEMPORARY_SUFFIX}") -> list[Path]:
    """Temporary files in `folder` (matching `pattern`) of writers killed before their rename,
    in the way (`aws s3 sync` copies them). Only where no other process writes there meanwhile."""
    stale = [path for path in Path(folder).glob(pattern) if path.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


@contextlib.contextmanager
def atomic_path(path: str | Path, durable: bool = False) -> Iterator[Path]:
    """Yields a temporary path to write; on success it is renamed onto `path`, on failure
    removed. `durable` also fsyncs the file and the folder, so the new file survives a power
    loss (checkpoints), not only a crash of the process."""
    path = Path(path)
    temporary = temporary_path(path)
    try:
        yield temporary
        if durable:
            with open(temporary, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    if durable:
        fsync_folder(path.parent)


def write_atomically(path: str | Path, data: bytes | str, durable: bool = False) -> None:
    with atomic_path(path, durable) as temporary:
        if isinstance(data, str):
            temporary.write_text(data, encoding="utf-8")
        else:
            temporary.write_bytes(data)


def create_if_absent(path: str | Path, data: str) -> bool:
    """Write `path` only if it does not exist yet, atomically: a hard link of a complete
    temporary file fails when the name exists, so of several processes exactly one creates it
    and nobody ever sees it half-written. True if this call created it."""
    path = Path(path)
    temporary = temporary_path(path)
    temporary.write_text(data, encoding="utf-8")
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    finally:
        temporary.unlink(missing_ok=True)


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def stamp(path: Path) -> tuple[int, int] | None:
    """(size, mtime_ns) of a file: whether it changed since; None once it is gone."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns

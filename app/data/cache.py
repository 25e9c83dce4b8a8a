"""A local disk cache of remote blobs, bounded in size, shared by every loader process.

It fills up to `max_bytes` and then stays as it is: each epoch reads every image once in a new
random order, so an LRU cache smaller than the dataset would evict each image just before its
next use; one that keeps what it has serves size / dataset of every epoch.
"""

from __future__ import annotations

from pathlib import Path

from app.catalog.fetcher import acquired, machine_lock
from app.catalog.storage import url_folder
from app.runtime.files import write_atomically

IMAGES = "images"  # their kind in the cache folder, beside archives/, shards/, models/
LEDGER = ".bytes"  # total bytes admitted so far, updated under the machine's lock beside it
# A holder that takes longer is stopped (SIGSTOP, a debugger): the image then goes uncached.
LEDGER_WAIT_S = 10.0


class DiskCache:
    def __init__(self, folder: str | Path, max_bytes: int):
        self.folder = Path(folder).expanduser()
        self.max_bytes = max_bytes
        self.full = False

    @classmethod
    def for_dataset(cls, cache_dir: str, url: str, max_gb: float) -> "DiskCache":
        """One sub-folder per dataset URL, so two datasets never share entries."""
        return cls(url_folder(url, IMAGES, cache_dir), int(max_gb * 2**30))

    def get(self, path: str) -> bytes | None:
        try:
            return (self.folder / path).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def has(self, path: str) -> bool:
        return (self.folder / path).is_file()

    def put(self, path: str, data: bytes) -> None:
        if self.full or not self._admit(len(data)):
            return
        target = self.folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(target, data)  # readers see the whole file or none

    def _admit(self, size: int) -> bool:
        self.folder.mkdir(parents=True, exist_ok=True)
        held = machine_lock(self.folder / LEDGER)
        if not acquired(held, LEDGER_WAIT_S):
            return False
        try:
            with open(self.folder / LEDGER, "a+") as ledger:
                ledger.seek(0)
                used = int(ledger.read() or 0)
                if used + size > self.max_bytes:
                    self.full = True
                    return False
                ledger.seek(0)
                ledger.truncate()
                ledger.write(str(used + size))
        finally:
            held.release()
        return True

    def used_bytes(self) -> int:
        try:
            return int((self.folder / LEDGER).read_text() or 0)
        except FileNotFoundError:
            return 0

"""Samples of the shard layouts, read by offset from the local copy of their shard.

A process's first read of a shard opens it through the machine's ShardStore (fetched whole and
indexed by whichever process asked first); each sample after that is one pread. Each read also
has a background thread fetch the next window's shards, then trim the cache, never evicting the
previous, current or next window: a rank seldom waits, and the machine fetches each shard once.
A sample without image bytes is skipped like an unreadable image; a shard that cannot be
fetched or is damaged ends the run with its one-line ShardError.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.util import Finalize

import pandas as pd

from app.catalog.shard_index import REDOWNLOAD, ShardError
from app.catalog.shard_store import LocalShard, ShardStore
from app.catalog.storage import DatasetRoot
from app.data.mapped import Rows, mapped
from app.data.windows import WindowedBatches
from app.runtime.errors import UserError

FETCHES_AT_ONCE = 4  # shards a batch needs, fetched side by side
STOP_WAIT_S = 60.0  # for the shard being fetched ahead when the process ends
Sample = tuple[bytes | None, str, int]  # (bytes, "", label) or (None, why not, label)


class ShardSamples(Rows):
    """Picklable: the open files and the prefetch thread belong to the process that reads."""

    def __init__(self, root: DatasetRoot, frame: pd.DataFrame, batches: WindowedBatches):
        super().__init__(frame)
        self.store = ShardStore(root)
        self.batches = batches
        self.shard_of = frame.shard.to_numpy()
        self.names = {int(s): self.name(int(batches.starts[s])).rsplit("#", 1)[0]
                      for s in range(batches.shard_count)
                      if batches.starts[s + 1] > batches.starts[s]}
        self._open: OrderedDict[int, tuple[int, LocalShard]] = OrderedDict()
        self._prefetch: threading.Thread | None = None
        self._prefetched: tuple[int, int] | None = None  # (epoch, window) asked for last
        self._stopping: threading.Event | None = None

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_open": OrderedDict(), "_prefetch": None,
                "_prefetched": None, "_stopping": None, "shard_of": mapped(self.shard_of)}

    def read(self, rows: list[int], upcoming: list[int] = (), epoch: int = 0) -> list[Sample]:
        """`upcoming` is not needed: the next window is fetched ahead instead."""
        if rows:
            self.prefetch_after(int(self.shard_of[rows[0]]), epoch)
            self.open_all({int(self.shard_of[row]) for row in rows} - set(self._open))
        return [self.sample(row) for row in rows]

    def open_all(self, shards: set[int]) -> None:
        """The shards a batch needs, fetched side by side (a window's first batch needs most)."""
        if len(shards) > 1:
            with ThreadPoolExecutor(min(len(shards), FETCHES_AT_ONCE)) as pool:
                list(pool.map(lambda shard: self.store.open(self.names[shard]), shards))
        for shard in shards:
            self.local(shard)

    def sample(self, row: int) -> Sample:
        shard = int(self.shard_of[row])
        fd, local = self.local(shard)
        ordinal = int(self.name(row).rsplit("#", 1)[1])
        if ordinal >= len(local.index):  # the info file counted more than the tar holds
            raise ShardError(f"shard {self.store.root.describe(self.names[shard])} is "
                             f"truncated: it ends after {len(local.index)} samples, at byte "
                             f"offset {local.data.stat().st_size}, but the split lists sample "
                             f"{ordinal}; {REDOWNLOAD}")
        label = int(self.labels[row]) if self.labels[row] >= 0 else int(local.index.labels[ordinal])
        size, offset = int(local.index.sizes[ordinal]), int(local.index.offsets[ordinal])
        if size == 0:
            return None, "no image bytes in the shard", label
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise ShardError(f"shard {self.store.root.describe(self.names[shard])}: sample "
                             f"{ordinal} at byte offset {offset} needs {size} bytes, the file "
                             f"ends first (changed since it was indexed?); remove "
                             f"{self.store.fetched_path(self.names[shard]).parent} and resume "
                             "with --resume auto")
        return data, "", label

    def local(self, shard: int) -> tuple[int, LocalShard]:
        """The shard's open file and index, kept open for the window's other samples."""
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        try:
            local = self.store.open(self.names[shard])
            fd = os.open(local.data, os.O_RDONLY)
        except FileNotFoundError:  # evicted by another process in between: fetched again
            local = self.store.open(self.names[shard])
            fd = os.open(local.data, os.O_RDONLY)
        self._open[shard] = (fd, local)
        while len(self._open) > 2 * self.batches.window + 2:
            os.close(self._open.popitem(last=False)[1][0])
        return self._open[shard]

    def prefetch_after(self, shard: int, epoch: int) -> None:
        """Start fetching the window after `shard`'s (the next epoch's first after the last)."""
        windows = self.batches.windows(epoch)
        number = next((n for n, w in enumerate(windows) if shard in w), 0)
        if self._prefetched == (epoch, number) or (
                self._prefetch is not None and self._prefetch.is_alive()):
            return
        self._prefetched = (epoch, number)
        following = windows[number + 1] if number + 1 < len(windows) else \
            self.batches.windows(epoch + 1)[0]
        wanted = [self.names[s] for s in following if s in self.names]
        # the window before stays too: a rank a step behind may still read it
        around = windows[max(0, number - 1):number + 1]
        keep = set(wanted) | {self.names[s] for w in around for s in w if s in self.names}
        if self._stopping is None:
            self._stopping = threading.Event()
            # Joined before this process tears down: one exiting while the thread is inside
            # native code aborts ("terminate called without an active exception").
            Finalize(self, stop_prefetch, args=(self._stopping, self), exitpriority=10)
        self._prefetch = threading.Thread(target=self.fetch, args=(wanted, keep), daemon=True,
                                          name="shard-prefetch")
        self._prefetch.start()

    def fetch(self, shards: list[str], keep: set[str]) -> None:
        """Best effort: a failure here is met again, and reported, by the read that needs it."""
        try:  # one at a time: threads of its own could outlive a loader process's exit
            for shard in shards:
                if self._stopping.is_set():
                    return
                self.store.open(shard, wait=False)
            self.store.evict(keep)
        except (UserError, OSError):  # noqa: S110 (the foreground read reports it)
            pass


def stop_prefetch(stopping: threading.Event, samples: ShardSamples) -> None:
    """Let the prefetch thread finish the shard it is at, and no more."""
    stopping.set()
    if samples._prefetch is not None:  # noqa: SLF001
        samples._prefetch.join(STOP_WAIT_S)  # noqa: SLF001

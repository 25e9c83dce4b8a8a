"""Shards on this machine's disk: fetched whole with a few large reads, indexed once, shared by
every process of the machine (the ranks and their loader processes).

One folder per dataset URL (below the entry's `cache_dir`, else the project's cache folder):
`data/` holds fetched tars and the image bytes unpacked from parquet files, `index/` each
shard's index (app/catalog/shard_index.py), `locks/` one lock file per shard. Whoever needs a
shard first takes its lock (flock: the kernel releases it if the holder dies), fetches it to a
temporary file, indexes it and renames both into place; everyone else waits for the lock and
then finds the shard ready, so a machine downloads each shard once however many ranks read it.
Local tars are read where they are (only their index is written here).

The data folder is bounded (`cache_max_gb`): the reader evicts the least recently opened
shards outside the current and next windows (app/data/shard_reader.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from app.catalog.shard_index import (RESUME, ShardError, ShardIndex, index_tar, missing_shard,
                                     unpack_parquet)
from app.catalog.storage import DatasetRoot, default_cache_dir
from app.runtime.errors import first_line
from app.runtime.files import atomic_path, remove_temporaries, temporary_path

DEFAULT_CACHE_GB = 50.0
CHUNK_BYTES = 16 << 20  # per read of a fetched shard: a 1 GB shard is a few dozen reads
ATTEMPTS = 3  # per shard, as per image (app/data/reader.py), on top of the client's retries
BACKOFF_S = 0.5
LOCK_WAIT_S = 900.0  # another process fetching a shard: far longer than a 1 GB download takes
POLL_S = 0.05


@dataclass(frozen=True)
class LocalShard:
    data: Path  # the file the index's offsets point into
    index: ShardIndex


class ShardStore:
    """Picklable: nothing is open between calls."""

    def __init__(self, root: DatasetRoot):
        self.root = root
        base = root.options.get("cache_dir") or default_cache_dir() / "shards"
        self.folder = Path(base).expanduser() / hashlib.sha1(root.url.encode()).hexdigest()[:16]
        self.max_bytes = int(root.options.get("cache_max_gb", DEFAULT_CACHE_GB) * 2**30)
        # a local tar is read in place; everything else is fetched or unpacked here
        self.in_place = root.is_local and root.layout == "wds"

    def index_path(self, shard: str) -> Path:
        return self.folder / "index" / (_flat(shard) + ".npz")

    def data_path(self, shard: str) -> Path:
        return Path(self.root.path(shard)) if self.in_place else \
            self.folder / "data" / _flat(shard)

    def ready(self, shard: str) -> bool:
        return self.index_path(shard).is_file() and self.data_path(shard).is_file()

    def open(self, shard: str, wait: bool = True) -> LocalShard | None:
        """The shard on local disk, fetched and indexed first if needed (waiting while another
        process does it); None when `wait` is False and another process is at it."""
        if not self.ready(shard):
            with ShardLock(self.folder / "locks" / _flat(shard), shard, wait) as held:
                if not held:
                    return None
                if not self.ready(shard):  # the holder before us may have done it
                    self.materialise(shard)
        data = self.data_path(shard)
        if not self.in_place:
            os.utime(data)  # recently used: evicted last
        return LocalShard(data, ShardIndex.load(self.index_path(shard)))

    def materialise(self, shard: str) -> None:
        """Under the shard's lock: any temporary file of this shard is a killed holder's."""
        for folder in ("index", "data"):
            (self.folder / folder).mkdir(parents=True, exist_ok=True)
            remove_temporaries(self.folder / folder, f".{_flat(shard)}.*")
        index_file, data = self.index_path(shard), self.data_path(shard)
        if self.in_place:
            index_tar(data, self.root.describe(shard)).save(index_file)
            return
        with atomic_path(data) as fetched:
            if self.root.layout == "wds":
                self.fetch(shard, fetched)
                index = index_tar(fetched, self.root.describe(shard))
            elif self.root.is_local:
                index = unpack_parquet(Path(self.root.path(shard)), fetched,
                                       self.root.describe(shard))
            else:
                downloaded = temporary_path(self.folder / "data" / (_flat(shard) + ".parquet"))
                try:
                    self.fetch(shard, downloaded)
                    index = unpack_parquet(downloaded, fetched, self.root.describe(shard))
                finally:
                    downloaded.unlink(missing_ok=True)
            index.save(index_file)  # the index first: `ready` needs both

    def fetch(self, shard: str, target: Path) -> None:
        """The whole shard into `target`: one streamed GET (obstore) or large sequential reads
        (fsspec); a failure, a vanished shard included, is tried again like a GET."""
        error: BaseException | None = None
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                with open(target, "wb") as out:
                    self._copy(shard, out)
                return
            except Exception as failure:  # noqa: BLE001 (missing, 5xx, dropped: try again)
                error = failure
        cause = f" after {ATTEMPTS} attempts ({first_line(error, 120, with_type=True)})"
        if self.not_found(error):
            raise missing_shard(self.root.describe(shard), cause)
        raise ShardError(f"shard {self.root.describe(shard)} is unreadable{cause}; check that "
                         f"it is readable, then {RESUME}")

    def not_found(self, error: BaseException | None) -> bool:
        """fsspec says FileNotFoundError; obstore's NotFoundError is not one."""
        if isinstance(error, FileNotFoundError):
            return True
        if self.root.reader != "obstore":
            return False
        from obstore.exceptions import NotFoundError  # noqa: PLC0415
        return isinstance(error, NotFoundError)

    def _copy(self, shard: str, out) -> None:
        if self.root.reader == "obstore":
            import obstore  # noqa: PLC0415
            for chunk in obstore.get(self.root.store, shard).stream(min_chunk_size=CHUNK_BYTES):
                out.write(chunk)
            return
        with self.root.fs.open(self.root.path(shard), "rb", block_size=CHUNK_BYTES) as source:
            shutil.copyfileobj(source, out, CHUNK_BYTES)

    def evict(self, keep: set[str]) -> None:
        """Remove the least recently opened shards not in `keep` until the data folder fits its
        bound (indices are small and stay). A reader that has one open keeps reading it."""
        if self.in_place:
            return
        folder = self.folder / "data"
        files = [(entry.stat().st_mtime, entry.stat().st_size, entry) for entry in
                 os.scandir(folder) if entry.is_file() and not entry.name.startswith(".")]
        used = sum(size for _, size, _ in files)
        protected = {_flat(shard) for shard in keep}
        for _, size, entry in sorted(files, key=lambda f: f[0]):
            if used <= self.max_bytes:
                break
            if entry.name not in protected:
                Path(entry.path).unlink(missing_ok=True)
                used -= size

    def used_bytes(self) -> int:
        folder = self.folder / "data"
        return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file()) \
            if folder.is_dir() else 0


class ShardLock:
    """An exclusive flock on the shard's lock file, waited for at most LOCK_WAIT_S (polling,
    so the wait has a bound); `wait=False` gives up at once. The holder writes its pid there,
    for the message when the wait runs out."""

    def __init__(self, path: Path, shard: str, wait: bool):
        self.path, self.shard, self.wait = path, shard, wait
        self.handle = None

    def __enter__(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(self.path, "a+")
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not self.wait:
                    return False
                if time.monotonic() > deadline:
                    self.handle.seek(0)
                    holder = self.handle.read().strip() or "?"
                    raise ShardError(f"waited {LOCK_WAIT_S:.0f} s for shard {self.shard}, "
                                     f"which process {holder} is fetching; if that process "
                                     f"hangs, stop it (or remove {self.path})") from None
                time.sleep(POLL_S)
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(str(os.getpid()))
        self.handle.flush()
        return True

    def __exit__(self, *exc) -> None:
        self.handle.close()  # releases the lock


def _flat(shard: str) -> str:
    """A shard's relative path as one file name (`data/train-0.parquet` -> `data__train-0...`)."""
    return shard.replace("/", "__")

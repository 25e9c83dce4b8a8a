"""Shards on this machine's disk: fetched whole (app/catalog/fetcher.py) and indexed once, under
the shard's lock, by whichever process of the machine needs one first; a local tar is read where
it is. A cache folder's shards are bounded (`cache_max_gb`): the reader evicts the least
recently opened outside the current and next windows (app/data/shard_reader.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from app.catalog.fetcher import FetchError, NotFound, cached_path, fetch, lock
from app.catalog.shard_index import (RESUME, ShardError, ShardIndex, index_tar, missing_shard,
                                     unpack_parquet)
from app.catalog.retry import ATTEMPTS, retried
from app.catalog.storage import DEFAULT_CACHE_GB, DatasetRoot, default_cache_dir
from app.runtime.files import atomic_path, remove_temporaries

SHARDS = "shards"  # their kind in the cache
NOT_DATA = (".index.npz",)  # what a shard's folder holds beside its data and hidden files


@dataclass(frozen=True)
class LocalShard:
    data: Path  # the file the index's offsets point into
    index: ShardIndex


class ShardStore:
    """Picklable: nothing is open between calls."""

    def __init__(self, root: DatasetRoot):
        self.root = root
        self.cache = Path(root.options.get("cache_dir") or default_cache_dir()).expanduser()
        self.folder = self.cache / SHARDS
        self.max_bytes = int(root.options.get("cache_max_gb", DEFAULT_CACHE_GB) * 2**30)
        # a local tar is read in place; everything else is fetched or unpacked here
        self.in_place = root.is_local and root.layout == "wds"

    def fetched_path(self, shard: str) -> Path:
        """Where the fetcher puts the shard; its folder holds the shard's other files too."""
        return cached_path(self.root.describe(shard), SHARDS, self.cache)

    def index_path(self, shard: str) -> Path:
        return _beside(self.fetched_path(shard), ".index.npz")

    def data_path(self, shard: str) -> Path:
        if self.in_place:
            return Path(self.root.path(shard))
        fetched = self.fetched_path(shard)
        return fetched if self.root.layout == "wds" else _beside(fetched, ".images")

    def ready(self, shard: str) -> bool:
        return self.index_path(shard).is_file() and self.data_path(shard).is_file()

    def open(self, shard: str, wait: bool = True) -> LocalShard | None:
        """The shard on local disk, made first if need be; None if `wait` is False and another
        process is making it (else it waits)."""
        if not self.ready(shard):
            with lock(self.index_path(shard), self.root.describe(shard), wait=wait) as held:
                if not held:
                    return None
                if not self.ready(shard):  # the holder before us may have done it
                    self.materialise(shard)
        data = self.data_path(shard)
        if not self.in_place:
            os.utime(data)  # recently used: evicted last
        return LocalShard(data, ShardIndex.load(self.index_path(shard)))

    def materialise(self, shard: str) -> None:
        """Under the shard's lock: any temporary file in its folder is a killed holder's."""
        index_file, data, named = self.index_path(shard), self.data_path(shard), \
            self.root.describe(shard)
        remove_temporaries(index_file.parent, ".*.tmp*")
        if self.root.layout == "wds":
            index = index_tar(data if self.in_place else self.fetch(shard), named)
        else:
            source = Path(self.root.path(shard)) if self.root.is_local else self.fetch(shard)
            with atomic_path(data) as unpacked:
                index = unpack_parquet(source, unpacked, named)
            if not self.root.is_local:
                source.unlink()  # its image bytes are all in `data` now
        index.save(index_file)  # last: `ready` needs it

    def fetch(self, shard: str) -> Path:
        """The whole shard in the cache, with our one layer of retries (app/catalog/retry.py): a
        shard cannot be skipped like an image, so a failed fetch is tried again whole (a cut one
        continued, a listed shard answered 404 by a bucket being synced asked for again)."""
        try:
            return retried(lambda: fetch(self.root, SHARDS, shard, cache=self.cache), FetchError)
        except FetchError as error:
            cause = f" after {ATTEMPTS} attempts ({error.why})"
            if isinstance(error, NotFound):
                raise missing_shard(self.root.describe(shard), cause) from None
            raise ShardError(f"shard {self.root.describe(shard)} is unreadable{cause}; check "
                             f"that it is readable, then {RESUME}") from None

    def data_files(self) -> list[Path]:
        """Every dataset's fetched and unpacked shards: the bound is the cache folder's."""
        return [file for file in self.folder.glob("*/*") if file.is_file()
                and not file.name.startswith(".") and not file.name.endswith(NOT_DATA)]

    def evict(self, keep: set[str]) -> None:
        """Remove the least recently opened shards not in `keep` until the folder's fit its bound
        (indices are small and stay). A reader that has one open keeps reading it."""
        if self.in_place:
            return
        files = [(file.stat(), file) for file in self.data_files()]
        used = sum(status.st_size for status, _ in files)
        protected = {self.fetched_path(shard).parent for shard in keep}
        for status, file in sorted(files, key=lambda f: f[0].st_mtime):
            if used <= self.max_bytes:
                break
            if file.parent not in protected:
                file.unlink(missing_ok=True)
                used -= status.st_size


def _beside(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)

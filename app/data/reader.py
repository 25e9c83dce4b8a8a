"""Bytes of many images at once from the dataset root.

A GET takes tens of milliseconds, so `concurrency` requests stay in flight: throughput is
concurrency / latency. Object stores are read through obstore by default
(app/data/object_store.py); `reader = "s3fs"` and other filesystems through fsspec's batched
`cat`, a batch at a time. Transient failures are the clients' to retry (app/catalog/retry.py);
a missing or unreadable blob becomes a reason, and its image is skipped like a bad image.
"""

from __future__ import annotations

from typing import Sequence

from app.catalog.retry import request_errors
from app.catalog.storage import DEFAULT_CACHE_GB, DEFAULT_CONCURRENCY, DatasetRoot
from app.data.cache import DiskCache
from app.data.object_store import ObjectStoreReads, Outcome, skip_reason


class BlobReader:
    """Picklable: the clients behind `root` are created in whichever process reads."""

    def __init__(self, root: DatasetRoot):
        self.root = root
        self.concurrency = root.options.get("concurrency", DEFAULT_CONCURRENCY)
        cache_dir = root.options.get("cache_dir")
        self.cache = DiskCache.for_dataset(cache_dir, root.url, root.options.get(
            "cache_max_gb", DEFAULT_CACHE_GB)) if cache_dir else None
        reads = ObjectStoreReads if root.reader == "obstore" else FsspecReads
        self.source = reads(root, self.concurrency)

    def read_many(self, paths: list[str], upcoming: Sequence[str] = ()
                  ) -> list[Outcome]:
        """(bytes, "") or (None, reason) per path; `upcoming`: paths likely asked for next."""
        results: dict[str, Outcome] = {}
        todo = []
        for path in paths:
            cached = self.cache.get(path) if self.cache else None
            if cached is None:
                todo.append(path)
            else:
                results[path] = (cached, "")
        if self.cache:
            upcoming = [path for path in upcoming if not self.cache.has(path)]
        for path, (data, reason) in self.source.read(todo, list(upcoming)).items():
            results[path] = (data, reason)
            if data is not None and self.cache:
                self.cache.put(path, data)
        return [results[path] for path in paths]


class FsspecReads:
    """fsspec's batched `cat`, a batch at a time: `upcoming` is not fetched ahead."""

    def __init__(self, root: DatasetRoot, concurrency: int):
        self.root = root
        self.concurrency = concurrency

    def read(self, paths: list[str], upcoming: list[str] = ()) -> dict[str, Outcome]:
        results: dict[str, Outcome] = {}
        for path, value in self.fetch(paths).items():
            if isinstance(value, bytes):
                results[path] = (value, "")
            elif isinstance(value, request_errors()):  # after the client's tries, if it has any
                results[path] = (None, skip_reason(value, retried=self.root.reader == "s3fs"))
            else:
                raise value  # a bug, not a failed read
        return results

    def fetch(self, paths: list[str]) -> dict[str, bytes | BaseException]:
        try:
            return self.root.read_many(paths, self.concurrency)
        except request_errors() as error:  # the whole round failed: each blob says why
            return {p: error for p in paths}

"""Bytes of many images at once from the dataset root.

On object stores each GET takes tens of milliseconds, so the reader keeps `concurrency`
requests in flight: throughput is concurrency / latency, not 1 / latency. Object stores are
read through obstore by default (app/data/object_store.py: little client CPU per GET, and the
next batches' requests in flight while the current one decodes); `reader = "s3fs"` and every
other filesystem read through fsspec (s3fs's batched async `cat`, one batch at a time).
Transient failures (5xx, throttling, dropped connections, timeouts; the clients retry those
first) get a few more tries with backoff here; a missing or unreadable blob becomes a reason
string, and the image is skipped and counted like a bad image.
"""

from __future__ import annotations

import time
from typing import Sequence

from app.catalog.storage import DEFAULT_CONCURRENCY, DatasetRoot
from app.data.cache import DiskCache
from app.data.object_store import ObjectStoreReads, Outcome
from app.runtime.errors import first_line

ATTEMPTS = 3  # per blob, on top of the client's own retries
BACKOFF_S = 0.2  # doubled after each failed attempt
DEFAULT_CACHE_GB = 50.0


class BlobReader:
    """Picklable: the clients behind `root` are created in whichever process reads."""

    def __init__(self, root: DatasetRoot, attempts: int = ATTEMPTS, backoff_s: float = BACKOFF_S):
        self.root = root
        self.concurrency = root.options.get("concurrency", DEFAULT_CONCURRENCY)
        cache_dir = root.options.get("cache_dir")
        self.cache = DiskCache.for_dataset(cache_dir, root.url, root.options.get(
            "cache_max_gb", DEFAULT_CACHE_GB)) if cache_dir else None
        reads = ObjectStoreReads if root.reader == "obstore" else FsspecReads
        self.source = reads(root, self.concurrency, attempts, backoff_s)

    def read_many(self, paths: list[str], upcoming: Sequence[str] = ()
                  ) -> list[Outcome]:
        """For each path (relative to the root): (bytes, "") or (None, reason). `upcoming`:
        paths likely asked for next, which readers that can may start fetching now."""
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
    """Rounds of fsspec's batched `cat` (concurrent where the filesystem is asynchronous, as
    s3fs is), the failed blobs of each round tried again after a backoff. Reads one batch at a
    time: `upcoming` is not fetched ahead."""

    def __init__(self, root: DatasetRoot, concurrency: int, attempts: int, backoff_s: float):
        self.root = root
        self.concurrency = concurrency
        self.attempts = attempts
        self.backoff_s = backoff_s

    def read(self, paths: list[str], upcoming: list[str] = ()) -> dict[str, Outcome]:
        results: dict[str, Outcome] = {}
        errors: dict[str, BaseException] = {}
        todo = list(paths)
        for attempt in range(self.attempts):
            if not todo:
                break
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            retry = []
            for path, value in self.fetch(todo).items():
                if isinstance(value, bytes):
                    results[path] = (value, "")
                elif isinstance(value, FileNotFoundError):
                    results[path] = (None, "missing")
                elif isinstance(value, PermissionError):
                    results[path] = (None, "access denied")
                else:
                    errors[path] = value
                    retry.append(path)
            todo = retry
        for path in todo:
            results[path] = (None, f"unreadable after {self.attempts} attempts: "
                                   f"{first_line(errors[path], with_type=True)}")
        return results

    def fetch(self, paths: list[str]) -> dict[str, bytes | BaseException]:
        """One round of reads, concurrent where the filesystem is asynchronous."""
        fs = self.root.fs
        full = {fs._strip_protocol(self.root.path(p)): p for p in paths}
        options = {"batch_size": self.concurrency} if getattr(fs, "async_impl", False) else {}
        try:
            out = fs.cat(list(full), on_error="return", **options)
        except Exception as error:  # noqa: BLE001 (the whole round failed: retry all of it)
            return {p: error for p in paths}
        if not isinstance(out, dict):  # a single path comes back as its bytes
            out = {next(iter(full)): out}
        return {path: out.get(key, FileNotFoundError(path)) for key, path in full.items()}

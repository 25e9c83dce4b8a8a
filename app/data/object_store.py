"""Image bytes from an object store (s3://, gs://, az://) through obstore, the next batches'
requests in flight while the current batch decodes.

One GET per image on a pool of `concurrency` threads (obstore releases the GIL; threads cost
less CPU per GET than its asyncio calls, measured). The images the caller will ask
for next (`upcoming`) queue behind the current batch's, so a loader process never waits a whole
round trip between batches; only the current and announced images are kept.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait

from app.catalog.retry import ATTEMPTS, DENIED, INVALID, MISSING, failure, request_errors
from app.catalog.storage import DatasetRoot

Outcome = tuple[bytes | None, str]  # (bytes, "") or (None, why not)

# A batch waits at most this long for its images (each GET has its own timeouts and
# retries: app/catalog/retry.py); the ones still missing then are skipped, not waited for.
WAIT_LIMIT_S = 300.0


class ObjectStoreReads:
    """Picklable: the thread pool and the store client are created in the reading process."""

    def __init__(self, root: DatasetRoot, concurrency: int):
        self.root = root
        self.concurrency = concurrency
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pool": None, "_pending": {}}

    def __del__(self) -> None:
        # GETs announced but not started would otherwise still run before the process exits.
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def read(self, paths: list[str], upcoming: list[str] = ()) -> dict[str, Outcome]:
        if self._pool is None:
            self.root.store  # noqa: B018 (the client, made once here, not by each thread)
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="object-store")
        wanted = set(paths) | set(upcoming)
        for path in [p for p in self._pending if p not in wanted]:
            self._pending.pop(path).cancel()  # no longer announced: free its slot and bytes
        for path in [*paths, *upcoming]:  # the pool's queue is first in, first out
            if path not in self._pending:
                self._pending[path] = self._pool.submit(self._get, path)
        futures = {path: self._pending.pop(path) for path in dict.fromkeys(paths)}
        _, late = wait(futures.values(), timeout=WAIT_LIMIT_S)
        for future in late:
            future.cancel()
        return {path: future.result() if future.done() and not future.cancelled()
                else (None, f"no answer within {WAIT_LIMIT_S:.0f} s")
                for path, future in futures.items()}

    def _get(self, path: str) -> Outcome:
        import obstore  # noqa: PLC0415 (loads in the reading process only)
        try:
            return bytes(obstore.get(self.root.store, path).bytes()), ""
        except request_errors() as error:  # what is left after obstore's own tries
            return None, skip_reason(error, retried=True)


def skip_reason(error: BaseException, retried: bool) -> str:
    """Why an image whose read failed is skipped, short (skipped.tsv's `reason`): "missing",
    "access denied", or what the client said (`retried`: after the client's tries)."""
    failed = failure(error)
    if failed.kind in (MISSING, DENIED):
        return failed.kind
    if failed.kind == INVALID:
        return f"not a valid object name: {failed.said}"
    return f"unreadable{f' after {ATTEMPTS} attempts' if retried else ''}: {failed.words}"

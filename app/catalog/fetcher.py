"""The one way a whole remote file reaches this machine (an archive, a checkpoint, a model, a
shard): once per machine, into the cache folder (an entry's `cache_dir`, else IMAGENET_DP_CACHE,
else ~/.cache/imagenet-dp) as <kind>/<16 hex of the URL's sha256>/<file name>, there only when
whole, beside its .lock and its .part (the download, or its cut). A cached copy is used while
`is_current`; a cut download is continued. `where` names the catalog entry to edit in messages
("" for a command line's URL).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import posixpath
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlsplit

from filelock import FileLock, Timeout
from tqdm import tqdm

from app.catalog.retry import request_errors
from app.catalog.storage import Location, default_cache_dir, scheme_of
from app.runtime.errors import UserError, first_line

CHUNK_BYTES = 8 << 20  # per read and write
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# Only ends a wait on a holder hung elsewhere: the kernel frees a dead holder's lock, and a
# stalled download fails within the clients' read timeouts.
LOCK_WAIT_S = 1800.0

Report = Callable[[str], None] | None
Checksum = tuple[str, str]  # (hashlib's name of the algorithm, hex digest)


class FetchError(UserError):
    """The file did not arrive whole (no connection, a 5xx, a cut): another try may fetch it."""

    def __init__(self, message: str, why: str = ""):
        super().__init__(message)
        self.why = why  # the client's own words, for callers that phrase the message their way


class NotFound(FetchError):
    """No file at the URL (HTTP 404, no such key, no such local file)."""


def cached_path(url: str, kind: str, cache: str | Path | None = None) -> Path:
    """Where `fetch` puts the file at `url`: a folder per URL, so files of one name never meet."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    name = posixpath.basename(urlsplit(url).path.rstrip("/")) or "file"
    return (Path(cache).expanduser() if cache else default_cache_dir()) / kind / digest / name


def fetch(source: Location, kind: str, relative: str = "", checksum: Checksum | None = None,
          cache: str | Path | None = None, where: str = "", report: Report = None) -> Path:
    """`source`'s file `relative` (`source` itself for "") in the cache, fetched unless current."""
    remote = Remote(source, relative, where)
    local = cached_path(remote.url, kind, cache)
    with lock(local, remote.url, report, where=where):
        if local.is_file() and is_current(local, remote, checksum):
            return local
        part = local.with_name(local.name + ".part")
        digest = download(remote, part, checksum[0] if checksum else None, report)
        if checksum and digest != checksum[1]:
            part.unlink()
            raise UserError(f"{remote.url} has {checksum[0]} {digest}, but the catalog expects "
                            f"{checksum[1]}; removed the download (the next run downloads it "
                            "again); if the file changed at its source, update "
                            f"`{checksum[0]}` of {where}")
        os.replace(part, local)
    return local


@contextlib.contextmanager
def lock(target: Path, url: str, report: Report = None, wait: bool = True,
         where: str = "") -> Iterator[bool]:
    """One process of the machine makes `target` (fetches, unpacks it); the others wait (saying
    so once), then find it made. `wait=False` yields False instead of waiting."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create the cache folder {target.parent} ({error.strerror}); "
                        f"set IMAGENET_DP_CACHE{_or_cache_dir(where)} to a writable folder"
                        ) from None
    held = machine_lock(target)
    if not acquired(held, 0):
        if not wait:
            yield False
            return
        say(report, f"waiting for another process that downloads {url} into {target} "
                     f"(at most {_duration(LOCK_WAIT_S)})")
        if not acquired(held, LOCK_WAIT_S):
            raise UserError(f"waited {_duration(LOCK_WAIT_S)} for another process to download "
                            f"{url} into {target}; stop it if it hangs (the process that holds "
                            f"{held.lock_file}), then run again")
    try:
        yield True
    finally:
        held.release()


def machine_lock(target: Path) -> FileLock:
    """The lock beside `target` that every process of the machine takes to make or change it:
    the one way this program locks files. The kernel frees it with its process, however it ends."""
    return FileLock(f"{target}.lock")


def acquired(held: FileLock, timeout_s: float) -> bool:
    try:
        held.acquire(timeout=timeout_s)
        return True
    except Timeout:
        return False


def is_current(local: Path, remote: Remote, checksum: Checksum | None) -> bool:
    """A cached file with a checksum is hashed again; one without is as current as its size (a
    run's last.pt is replaced as it trains, not edited)."""
    if checksum:
        with open(local, "rb") as file:
            return hashlib.file_digest(file, checksum[0]).hexdigest() == checksum[1]
    return local.stat().st_size == remote.size


class RangesIgnored(Exception):
    """A cut download cannot be continued: the server answers a Range request with the whole
    file (fsspec will not read on then), or says it takes none (fsspec will not seek)."""


class Remote:
    """The file's bytes: through fsspec, or through obstore where the root reads with it."""

    def __init__(self, source: Location, relative: str, where: str):
        self.source, self.relative, self.where = source, relative, where
        self.url = source.describe(relative)
        self.streams = source.reader == "obstore"

    @functools.cached_property
    def size(self) -> int | None:
        """The object's size in bytes (a HEAD request); None where the server does not say."""
        with self.reaching():
            if self.streams:
                import obstore  # noqa: PLC0415 (loads with the first object-store read)
                return obstore.head(self.source.store, self.relative)["size"]
            return self.source.fs.size(self._path)

    @property
    def _path(self) -> str:
        return self.source.path(self.relative) if self.relative else self.source.root

    def read(self, offset: int) -> Iterator[bytes]:
        """The bytes from `offset` on; RangesIgnored where the server cannot start there."""
        if self.streams:
            import obstore  # noqa: PLC0415
            with self.reaching():
                got = obstore.get(self.source.store, self.relative,
                                  options={"range": {"offset": offset}} if offset else None)
            self.size = got.meta["size"]  # the GET says it: no HEAD request
            return iter(got.stream(min_chunk_size=CHUNK_BYTES))
        self.size  # noqa: B018 (asked first: a missing file is not a cut download)
        # http streams the whole body in one GET only with block_size=0, and seeks (a ranged GET
        # per block) only without it. Other filesystems read blocks either way.
        whole = not offset and scheme_of(self._path) in ("http", "https")
        file = self.source.fs.open(self._path, "rb", block_size=0 if whole else CHUNK_BYTES)
        try:
            file.seek(offset)
            first = file.read(CHUNK_BYTES)
        except BaseException as error:
            file.close()
            if offset and isinstance(error, ValueError):
                raise RangesIgnored() from None
            raise
        return _chunks(file, first)

    @contextlib.contextmanager
    def reaching(self) -> Iterator[None]:
        try:
            yield
        except request_errors() as error:
            raise unreachable(self.url, self.where, error) from None


def download(remote: Remote, part: Path, algorithm: str | None, report: Report) -> str | None:
    """The file's bytes into `part`, continued with a Range request where a cut download left
    some; the hex digest of the whole file by `algorithm` (hashlib's name), if one is given."""
    kept = part.stat().st_size if part.is_file() else 0
    # Without a size there is no knowing where a cut left off; a larger file changed since.
    offset = kept if kept and remote.size and kept <= remote.size else 0
    try:
        try:
            chunks = remote.read(offset)
        except RangesIgnored:
            say(report, f"{remote.url}: the server does not continue downloads (it ignores "
                        "Range requests); downloading it again from the start")
            offset, chunks = 0, remote.read(0)
        size = remote.size
        total = format_size(size) if size else "size unknown"
        say(report, f"continuing the download of {remote.url} at {format_size(offset)} of "
                    f"{total} into {part.parent} (first use only)" if offset else
                    f"downloading {remote.url} ({total}) into {part.parent} (first use only)")
        with tqdm(total=size, initial=offset, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=part.name[:-len(".part")], disable=report is None) as bar:
            digest = copy(chunks, part, offset, algorithm, bar)
    except request_errors() as error:  # OSError among them
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            part.unlink(missing_ok=True)  # the room it took is room the user needs
            needs = f"the file takes {format_size(remote.size)}" if remote.size else "the file"
            raise no_room(remote.url, part.parent, error, remote.where, needs) from None
        raise cut(remote.url, part, remote.size, first_line(error, 200, True)) from None
    if size and part.stat().st_size != size:  # closed early, without a Content-Length
        raise cut(remote.url, part, size, "the server closed the connection")
    return digest


def copy(chunks: Iterator[bytes], part: Path, offset: int, algorithm: str | None,
         bar: tqdm) -> str | None:
    """`chunks` into `part` from `offset` on; the hex digest of the whole file."""
    hasher = hashlib.new(algorithm) if algorithm else None
    with open(part, "r+b" if offset else "wb") as out:
        out.truncate(offset)  # whatever followed the cut (a torn last write) goes
        while hasher and out.tell() < offset:  # the bytes kept are hashed again
            hasher.update(out.read(min(CHUNK_BYTES, offset - out.tell())))
        out.seek(offset)
        for chunk in chunks:
            out.write(chunk)
            if hasher:
                hasher.update(chunk)
            bar.update(len(chunk))
    return hasher.hexdigest() if hasher else None


def _chunks(file, chunk: bytes) -> Iterator[bytes]:
    with file:
        while chunk:
            yield chunk
            chunk = file.read(CHUNK_BYTES)


def unreachable(url: str, where: str, error: BaseException) -> FetchError:
    """The first request failed: a missing file, an HTTP status, refused credentials, no link."""
    from obstore.exceptions import NotFoundError, PermissionDeniedError  # noqa: PLC0415
    if isinstance(error, FileNotFoundError) and scheme_of(url) in ("http", "https") \
            and error.__cause__ is not None:
        error = error.__cause__  # fsspec's http says FileNotFoundError for any failed request
    why, check = first_line(error, 120, True), f"`url` of {where}" if where else "the URL"
    status = getattr(error, "status", None)  # aiohttp's ClientResponseError
    if status == 404 or isinstance(error, (FileNotFoundError, NotFoundError)):
        return NotFound(f"{url} not found{' (HTTP 404)' if status else ''}; check {check}", why)
    if isinstance(status, int):
        return FetchError(f"{url} answered HTTP {status}; check {check}, or try again later if "
                          "the server is busy", why)
    if isinstance(error, (PermissionError, PermissionDeniedError)):
        return FetchError(f"cannot download {url}: access denied ({why}); check the "
                          f"credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID, ...) and {check}", why)
    yourself = f", or download the file yourself and set `url` of {where} to its local path" \
        if where else ""
    return FetchError(f"cannot download {url} ({why}); check the network or the proxy "
                      f"(HTTPS_PROXY){yourself}", why)


def cut(url: str, part: Path, size: int | None, why: str) -> FetchError:
    got = part.stat().st_size if part.is_file() else 0
    of = f" of {format_size(size)}" if size else ""
    return FetchError(f"the download of {url} stopped at {format_size(got)}{of} ({why}); run "
                      f"again to continue it from {part} (where the server honours Range "
                      "requests; from the start where it does not)", why)


def no_room(url: str, folder: Path, error: OSError, where: str, needs: str) -> UserError:
    """A full disk (or quota, or file size limit) while a download or an unpacking writes."""
    return UserError(f"no room left in {folder} for {url} ({error.strerror}): {needs}; free "
                     f"space there, or set IMAGENET_DP_CACHE{_or_cache_dir(where)} to a folder "
                     "with room")


def _or_cache_dir(where: str) -> str:
    return f" or `cache_dir` of {where}" if where else ""


def format_size(count: int | None) -> str:
    return tqdm.format_sizeof(count or 0, "B", 1024)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def say(report: Report, line: str) -> None:
    if report:
        report(line)

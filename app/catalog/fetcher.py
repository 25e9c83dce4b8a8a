"""The one way a whole remote file reaches this machine (an archive, a checkpoint, a model, a
shard, a bucket's run folder's files): once per machine, into the cache folder (an entry's
`cache_dir`, else IMAGENET_DP_CACHE, else ~/.cache/imagenet-dp) as <kind>/<16 hex of the URL's
sha256>/<file name>, or to a path of the caller's (`fetch_to`: a run folder's staging), there
only when whole, beside its hidden .lock, .part (the download, or its cut) and .version (what
the source said of it: app/catalog/versions.py). A cached copy is used while `is_current`; a
cut download is continued. `where` names the catalog entry to edit in messages ("" for a
command line's URL).
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

import app.catalog.versions as versions
from app.catalog.retry import DENIED, INVALID, MISSING, STATUS, failure, request_errors
from app.catalog.storage import Location, scheme_of, url_folder
from app.catalog.versions import Version
from app.runtime.errors import UserError, first_line

CHUNK_BYTES = 8 << 20  # per read and write
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# Only ends a wait on a holder hung elsewhere: the kernel frees a dead holder's lock, and a
# stalled download fails within the clients' read timeouts.
LOCK_WAIT_S = 1800.0

Report = Callable[[str], None] | None
Checksum = tuple[str, str]  # (hashlib's name of the algorithm, hex digest)
# keep(local, download): True keeps the local file instead of the download of its source
Keep = Callable[[Path, Path], bool] | None


class FetchError(UserError):
    """The file did not arrive whole (no connection, a 5xx, a cut): another try may fetch it."""

    def __init__(self, message: str, why: str = ""):
        super().__init__(message)
        self.why = why  # the client's own words, for callers that phrase the message their way


class NotFound(FetchError):
    """No file at the URL (HTTP 404, no such key, no such local file)."""


def cached_path(url: str, kind: str, cache: str | Path | None = None) -> Path:
    """Where `fetch` puts the file at `url`: a folder per URL, so files of one name never meet."""
    name = posixpath.basename(urlsplit(url).path.rstrip("/")) or "file"
    return url_folder(url, kind, cache) / name


def fetch(source: Location, kind: str, relative: str = "", checksum: Checksum | None = None,
          cache: str | Path | None = None, where: str = "", report: Report = None) -> Path:
    """`source`'s file `relative` (`source` itself for "") in the cache, fetched unless current."""
    local = cached_path(source.describe(relative), kind, cache)
    return fetch_to(local, source, relative, checksum, where, report)


def fetch_to(local: Path, source: Location, relative: str = "", checksum: Checksum | None = None,
             where: str = "", report: Report = None, keep: Keep = None) -> Path:
    """`source`'s file `relative` at `local`, fetched unless current there. `keep` may keep a
    local file over its source's download (a run's record that grew here)."""
    remote = Remote(source, relative, where)
    with lock(local, remote.url, report, where=where):
        if local.is_file() and is_current(local, remote, checksum):
            return local
        part = hidden(local, "part")
        digest = download(remote, local, checksum[0] if checksum else None, report)
        if checksum and digest != checksum[1]:
            part.unlink()
            versions.remember(local)  # nothing of it is left
            raise UserError(f"{remote.url} has {checksum[0]} {digest}, but the catalog expects "
                            f"{checksum[1]}; removed the download (the next run downloads it "
                            "again); if the file changed at its source, update "
                            f"`{checksum[0]}` of {where}")
        if keep and local.is_file() and keep(local, part):
            part.unlink()
        else:
            os.replace(part, local)
        versions.remember(local, file=None if checksum else remote.version)
    return local


def hidden(local: Path, suffix: str) -> Path:
    """A file beside `local` that is its fetch's own (.part, .lock): hidden, so that a run
    folder's upload passes it over (app/catalog/uploader.py's record)."""
    return local.with_name(f"{'' if local.name.startswith('.') else '.'}{local.name}.{suffix}")


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
    return FileLock(hidden(target, "lock"))


def acquired(held: FileLock, timeout_s: float) -> bool:
    try:
        held.acquire(timeout=timeout_s)
        return True
    except Timeout:
        return False


def is_current(local: Path, remote: Remote, checksum: Checksum | None) -> bool:
    """A cached file with a checksum is hashed again; one without is current while it is the
    copy of the version its source has now (one HEAD request), unchanged here since."""
    if checksum:
        with open(local, "rb") as file:
            return hashlib.file_digest(file, checksum[0]).hexdigest() == checksum[1]
    return versions.is_copy_of(local, remote.version)


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
    def version(self) -> Version:
        """What the source says of the file now (a HEAD request): its size and version."""
        with self.reaching():
            if self.streams:
                import obstore  # noqa: PLC0415 (loads with the first object-store read)
                return versions.version_of(obstore.head(self.source.store, self.relative))
            self.source.fs.invalidate_cache(self._path)  # a listing's, maybe from long ago
            return versions.version_of(self.source.fs.info(self._path))

    @property
    def size(self) -> int | None:
        """The object's size in bytes; None where the server does not say."""
        return self.version.size

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
            self.version = versions.version_of(got.meta)  # of these bytes: no HEAD request
            return iter(got.stream(min_chunk_size=CHUNK_BYTES))
        self.version  # noqa: B018 (asked first: a missing file is not a cut download)
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


def download(remote: Remote, local: Path, algorithm: str | None, report: Report) -> str | None:
    """The file's bytes into `local`'s .part, continued with a Range request where a cut download
    of the same version left some; the hex digest of the whole file by `algorithm` (hashlib's
    name), if one is given."""
    part = hidden(local, "part")
    kept = part.stat().st_size if part.is_file() else 0
    # Without a size there is no knowing where a cut left off; a larger file changed since, and
    # bytes of another version of the same size would make a file that never was.
    offset = kept if kept and remote.size and kept <= remote.size and versions.part_is_of(
        local, remote.version) else 0
    try:
        try:
            chunks = remote.read(offset)
        except RangesIgnored:
            say(report, f"{remote.url}: the server does not continue downloads (it ignores "
                        "Range requests); downloading it again from the start")
            offset, chunks = 0, remote.read(0)
        if offset and not versions.part_is_of(local, remote.version):  # replaced since the HEAD
            offset, chunks = 0, remote.read(0)
        versions.remember(local, part=remote.version)  # what a cut leaves in `part` is of it
        size = remote.size
        say(report, _starting(remote.url, local, offset, size))
        with tqdm(total=size, initial=offset, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=local.name, disable=report is None) as bar:
            digest = copy(chunks, part, offset, algorithm, bar)
    except request_errors() as error:  # OSError among them
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            part.unlink(missing_ok=True)  # the room it took is room the user needs
            versions.remember(local)
            needs = f"the file takes {format_size(remote.size)}" if remote.size else "the file"
            raise no_room(remote.url, part.parent, error, remote.where, needs) from None
        raise cut(remote.url, part, remote.size, first_line(error, 200, True)) from None
    if size and part.stat().st_size != size:  # closed early, without a Content-Length
        raise cut(remote.url, part, size, "the server closed the connection")
    return digest


def _starting(url: str, local: Path, offset: int, size: int | None) -> str:
    total = format_size(size) if size else "size unknown"
    why = "the copy here is not its source's version now" if local.exists() else \
        "first use only"
    if offset:
        return (f"continuing the download of {url} at {format_size(offset)} of {total} into "
                f"{local.parent} ({why})")
    return f"downloading {url} ({total}) into {local.parent} ({why})"


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
    failed, check = failure(error), f"`url` of {where}" if where else "the URL"
    why = failed.words
    if failed.kind == MISSING:
        return NotFound(f"{url} not found{' (HTTP 404)' if failed.status else ''}; check "
                        f"{check}", why)
    if failed.kind == STATUS:
        return FetchError(f"{url} answered HTTP {failed.status}; check {check}, or try again "
                          "later if the server is busy", why)
    if failed.kind == DENIED:
        return FetchError(f"cannot download {url}: access denied ({why}); check the "
                          f"credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID, ...) and {check}", why)
    if failed.kind == INVALID:
        return FetchError(f"{url} is not a valid object name ({failed.said}); check {check}",
                          why)
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

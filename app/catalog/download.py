"""One file at any URL the catalog reads (https://, s3://, a local path, ...), downloaded whole
into a local file through fsspec, with a progress bar and its digest computed on the way.

A download that was cut (the connection closed, the process killed) leaves its bytes in the
file; the next call continues from there with a Range request where the server honours them,
and starts again from the first byte where it does not (fsspec then will not seek, or read on
from a whole-file answer). The bytes already there are hashed again, so a continued file is
verified whole.

Errors are one line naming the URL and what to do; `where` names the catalog entry to edit.
"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from app.catalog.storage import DatasetRoot, scheme_of
from app.runtime.errors import UserError, first_line

CHUNK_BYTES = 8 << 20  # per read and write: a 330 MB archive is ~40 of them
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}

Report = Callable[[str], None] | None


def download(url: str, storage_options: dict, part: Path, algorithm: str, where: str,
             report: Report = None) -> str:
    """The file's bytes into `part` (continued where a cut download left some); the hex digest
    of the whole file by `algorithm` (hashlib's name)."""
    source = DatasetRoot("download", url, storage_options)
    try:
        fs, path = source.fs, source.root
        size = fs.size(path)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 (aiohttp, botocore, OSError: say what to check)
        raise unreachable(url, where, error) from None
    kept = part.stat().st_size if part.is_file() else 0
    # Without a size there is no knowing where a cut left off; a larger file changed since.
    offset = kept if size and kept <= size else 0
    total = _size(size) if size else "size unknown"
    if offset:
        say(report, f"continuing the download of {url} at {_size(offset)} of {total} into "
                     f"{part.parent} (first use only)")
    else:
        say(report, f"downloading {url} ({total}) into {part.parent} (first use only)")
    with tqdm(total=size, initial=offset, unit="B", unit_scale=True, unit_divisor=1024,
              desc=Path(path).name.split("?")[0], disable=report is None) as bar:
        try:
            digest = transfer(url, fs, path, part, offset, algorithm, bar, report)
        except OSError as error:
            if error.errno in DISK_FULL:
                part.unlink(missing_ok=True)  # the room it took is room the user needs
                raise no_room(url, part.parent, error, where, size) from None
            raise cut(url, part, size, first_line(error, 200, True)) from None
        except Exception as error:  # noqa: BLE001 (aiohttp's, botocore's: the connection broke)
            raise cut(url, part, size, first_line(error, 200, True)) from None
    if size and part.stat().st_size != size:  # closed early, without a Content-Length
        raise cut(url, part, size, "the server closed the connection")
    return digest


def transfer(url: str, fs, path: str, part: Path, offset: int, algorithm: str, bar: tqdm,
             report: Report) -> str:
    """`copy`, started again from the first byte where the server cannot continue."""
    try:
        return copy(fs, path, part, offset, hashlib.new(algorithm), bar)
    except RangesIgnored:
        say(report, f"{url}: the server does not continue downloads (it ignores Range "
                     "requests); downloading it again from the start")
        bar.reset()
        return copy(fs, path, part, 0, hashlib.new(algorithm), bar)


class RangesIgnored(Exception):
    """A cut download cannot be continued: the server answers a Range request with the whole
    file (fsspec will not read on then), or says it takes none (fsspec will not seek)."""


def copy(fs, path: str, part: Path, offset: int, hasher, bar: tqdm) -> str:
    """Bytes from `offset` on into `part`; the hex digest of the whole file."""
    # http streams the whole body in one GET only with block_size=0, and seeks (a ranged GET
    # per block) only without it. Other filesystems read blocks either way.
    streams = not offset and scheme_of(path) in ("http", "https")
    with open(part, "r+b" if offset else "wb") as out:
        rehash_prefix(out, offset, hasher)
        with fs.open(path, "rb", block_size=0 if streams else CHUNK_BYTES) as remote:
            try:
                remote.seek(offset)
                chunk = remote.read(CHUNK_BYTES)
            except ValueError:
                if offset:
                    raise RangesIgnored() from None
                raise
            while chunk:
                out.write(chunk)
                hasher.update(chunk)
                bar.update(len(chunk))
                chunk = remote.read(CHUNK_BYTES)
    return hasher.hexdigest()


def rehash_prefix(out, offset: int, hasher) -> None:
    """The bytes a cut download left are hashed again, and whatever follows them (a torn last
    write) is cut off."""
    out.seek(0)
    while out.tell() < offset:
        chunk = out.read(min(CHUNK_BYTES, offset - out.tell()))
        if not chunk:
            break
        hasher.update(chunk)
    out.truncate(offset)
    out.seek(offset)


def unreachable(url: str, where: str, error: BaseException) -> UserError:
    """The first request failed: a missing file, another HTTP status, or no connection."""
    chain = _causes(error)
    status = next((e.status for e in chain if isinstance(getattr(e, "status", None), int)),
                  None)
    broken = next((e for e in chain if isinstance(e, OSError)
                   and not isinstance(e, FileNotFoundError)), None)
    if status == 404 or (status is None and broken is None
                         and isinstance(error, FileNotFoundError)):
        found = " (HTTP 404)" if status else ""
        return UserError(f"{url} not found{found}; check `url` of {where}")
    if status is not None:
        return UserError(f"{url} answered HTTP {status}; check `url` of {where}, or try again "
                         "later if the server is busy")
    return UserError(f"cannot download {url} ({first_line(broken or error, 120, True)}); check "
                     "the network or the proxy (HTTPS_PROXY), or download the file yourself "
                     f"and set `url` of {where} to its local path")


def cut(url: str, part: Path, size: int | None, why: str) -> UserError:
    got = part.stat().st_size if part.is_file() else 0
    of = f" of {_size(size)}" if size else ""
    return UserError(f"the download of {url} stopped at {_size(got)}{of} ({why}); run again "
                     f"to continue it from {part} (where the server honours Range requests; "
                     "from the start where it does not)")


def no_room(url: str, folder: Path, error: OSError, where: str, file_bytes: int | None,
            unpacked_bytes: int | None = None) -> UserError:
    """A full disk (or quota, or file size limit) while a download or its unpacking writes."""
    needs = f"the archive takes {_size(file_bytes)}" if file_bytes else "the archive"
    needs += (f" and unpacks to {_size(unpacked_bytes)}" if unpacked_bytes is not None
              else ", and about as much again to unpack it")
    return UserError(f"no room left in {folder} for {url} ({error.strerror}): {needs}; free "
                     "space there, or set IMAGENET_DP_CACHE or `cache_dir` of "
                     f"{where} to a folder with room")


def _causes(error: BaseException | None) -> list[BaseException]:
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _size(count: int | None) -> str:
    return tqdm.format_sizeof(count or 0, "B", 1024)


def say(report: Report, line: str) -> None:
    """A line for whoever watches the run (the driver's log), if anyone does."""
    if report:
        report(line)

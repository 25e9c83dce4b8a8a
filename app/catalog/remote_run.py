"""A run folder at a URL (s3://, gs://, az://): where it is staged on this machine, and the few
requests the run makes of the bucket (put, copy, delete, fetch), each retried with backoff.

The run writes into a local staging folder exactly as into a local run folder (atomic files,
hard-linked last.pt); app/catalog/uploader.py uploads what it is told the run saved. The clients
come from the catalog (Catalog.location: the settings of the entry whose bucket holds the URL,
else the AWS/GCP/Azure credential chains), as a dataset's do.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

from app.catalog.storage import DatasetRoot, default_cache_dir, scheme_of
from app.runtime.errors import UserError, first_line
from app.runtime.files import atomic_path

T = TypeVar("T")
# On top of botocore's own 3 attempts: 5xx, throttling and dropped connections mostly pass
# within seconds; a bucket that is down for longer: the upload process tries again later.
ATTEMPTS = 4
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
# Answers that no retry changes: the bucket refuses us, or is not there.
PERMANENT = (PermissionError, FileNotFoundError, FileExistsError, UserError)
# The clients' own errors (connections, credentials) beside the OSErrors the filesystems make of
# a bucket's answers; looked up where the client is imported (no request raises them otherwise).
CLIENT_ERRORS = {"botocore.exceptions": ("BotoCoreError", "ClientError"),
                 "aiohttp": ("ClientError",), "gcsfs.retry": ("HttpError",),
                 "google.auth.exceptions": ("GoogleAuthError",),
                 "azure.core.exceptions": ("AzureError",)}


def is_url(location: str) -> bool:
    return bool(scheme_of(location)) and scheme_of(location) != "file"


def staging_folder(output_url: str) -> Path:
    """Where the run folders of `output_url` are staged on this machine:
    <cache>/runs/<16 hex digits of the URL's sha256>/ (one folder per output URL, so two
    buckets' runs of one name never meet; the URL itself is in the folder's `url` file)."""
    url = output_url.rstrip("/")
    folder = default_cache_dir() / "runs" / hashlib.sha256(url.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "url").write_text(url + "\n", encoding="utf-8")
    return folder


def request_errors() -> tuple[type[BaseException], ...]:
    """What a request of the bucket raises when the bucket, the network or the credentials fail
    (a programming error is none of them)."""
    return (OSError, UserError, *(getattr(sys.modules[module], name) for module, names
                                  in CLIENT_ERRORS.items() if module in sys.modules
                                  for name in names))


def retried(action: Callable[[], T], deadline: float | None = None) -> T:
    """`action()`, tried again after transient failures (5xx, dropped connections, timeouts)
    with exponential backoff and jitter, at most ATTEMPTS times and never past `deadline`
    (time.monotonic()); refusals (403, no such bucket) are raised at once."""
    backoff = FIRST_BACKOFF_S
    for attempt in range(ATTEMPTS):
        try:
            return action()
        except PERMANENT:
            raise
        except Exception:  # noqa: BLE001 (botocore, aiohttp, OSError: all transient here)
            wait = backoff * (0.5 + random.random())
            if attempt == ATTEMPTS - 1 or (deadline and time.monotonic() + wait > deadline):
                raise
            time.sleep(wait)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
    raise AssertionError("unreachable")


class RemoteRunFolder:
    """<output URL>/<run name>/ in its bucket; paths are relative to it."""

    def __init__(self, root: DatasetRoot):
        self.root = root

    @property
    def url(self) -> str:
        return self.root.url

    def describe(self, relative: str = "") -> str:
        return self.root.describe(relative)

    def _path(self, relative: str) -> str:
        return self.root.path(relative)

    def put(self, local: Path, relative: str, deadline: float | None = None) -> None:
        """Upload a whole file; an object store shows the object only once all its bytes are
        there (a multipart upload becomes visible when it completes)."""
        retried(lambda: self.root.fs.put_file(str(local), self._path(relative)), deadline)

    def claim(self, relative: str, data: bytes) -> bool:
        """Write `relative` only if no object has that name (a conditional write, S3's
        If-None-Match: *): of two runs that take one name at the same moment, one gets it.
        False: the name is taken."""
        try:
            retried(lambda: self.root.fs.pipe_file(self._path(relative), data, mode="create"))
        except FileExistsError:
            return False
        return True

    def copy(self, source: str, target: str, deadline: float | None = None) -> None:
        """A copy inside the bucket (no bytes through this machine): atomic, as a put."""
        retried(lambda: self.root.fs.copy(self._path(source), self._path(target)), deadline)

    def delete(self, relative: str) -> None:
        retried(lambda: self.root.fs.rm_file(self._path(relative)))

    def sizes(self) -> dict[str, int]:
        """Every file of the run folder, relative to it, with its size in bytes."""
        self.root.fs.invalidate_cache()
        found = retried(lambda: self.root.fs.find(self._path(""), detail=True))
        return {self.root._relative(name): info.get("size", 0) for name, info in found.items()
                if info.get("type") != "directory"}

    def fetch(self, relative: str, local: Path) -> Path:
        """Download to `local` atomically (a cut download leaves no file of that name)."""
        local.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(local) as temporary:
            retried(lambda: self.root.fs.get_file(self._path(relative), str(temporary)))
        return local

    def check_writable(self) -> None:
        """Write and delete a small object: a bucket that refuses writes or does not exist
        stops the run here, before any worker starts."""
        probe = f".write-probe-{os.getpid()}-{random.randrange(1 << 30)}"
        try:
            retried(lambda: self.root.fs.pipe_file(self._path(probe), b"imagenet-dp"))
            retried(lambda: self.root.fs.rm_file(self._path(probe)))
        except UserError:
            raise
        except request_errors() as error:
            raise UserError(f"--output-dir: cannot write {self.describe()} "
                            f"({refusal(error)}); check that the bucket exists and that the "
                            "credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID, ...) may write "
                            "to it") from None


def refusal(error: BaseException) -> str:
    """What a failed request says, in one short line (403 and missing buckets by name)."""
    if isinstance(error, PermissionError):
        return "403 access denied: " + first_line(error, 120)
    if isinstance(error, FileNotFoundError):
        return "no such bucket or key: " + first_line(error, 120)
    return first_line(error, 160, with_type=True)


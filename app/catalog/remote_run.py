"""A run folder at a URL (s3://, gs://, az://): where it is staged on this machine (the run writes
there as into a local run folder; app/catalog/uploader.py uploads what it saved), and the few
requests the run makes of the bucket, each retried by its client (app/catalog/retry.py).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from app.catalog.retry import DENIED, MISSING, failure, request_errors
from app.catalog.storage import DatasetRoot, scheme_of, url_folder
from app.runtime.errors import UserError


def is_url(location: str) -> bool:
    return bool(scheme_of(location)) and scheme_of(location) != "file"


def staging_folder(output_url: str) -> Path:
    """<cache>/runs/<16 hex digits of the URL's sha256>/: one per output URL, so two buckets'
    runs of one name never meet (its `url` file names the URL)."""
    url = output_url.rstrip("/")
    folder = url_folder(url, "runs")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "url").write_text(url + "\n", encoding="utf-8")
    return folder


class RemoteRunFolder:
    """<output URL>/<run name>/ in its bucket; paths are relative to it."""

    def __init__(self, root: DatasetRoot):
        self.root = root

    @property
    def url(self) -> str:
        return self.root.url

    def describe(self, relative: str = "") -> str:
        return self.root.describe(relative)

    def put(self, local: Path, relative: str) -> None:
        """An object store shows the object only once all its bytes are there."""
        self.root.fs.put_file(str(local), self.root.path(relative))

    def claim(self, relative: str, data: bytes) -> bool:
        """Write `relative` only if no object has that name (S3's If-None-Match: *), so of two
        runs taking one name at once, one gets it. False: the name is taken."""
        try:
            self.root.fs.pipe_file(self.root.path(relative), data, mode="create")
        except FileExistsError:
            return False
        return True

    def copy(self, source: str, target: str) -> None:
        """A copy inside the bucket (no bytes through this machine): atomic, as a put."""
        self.root.fs.copy(self.root.path(source), self.root.path(target))

    def delete(self, relative: str) -> None:
        self.root.fs.rm_file(self.root.path(relative))

    def sizes(self) -> dict[str, int]:
        self.root.fs.invalidate_cache()
        found = self.root.fs.find(self.root.path(""), detail=True)
        return {self.root._relative(name): info.get("size", 0) for name, info in found.items()
                if info.get("type") != "directory"}

    def check_writable(self) -> None:
        """A bucket that refuses writes or does not exist stops the run before any worker."""
        probe = f".write-probe-{os.getpid()}-{random.randrange(1 << 30)}"
        try:
            self.root.fs.pipe_file(self.root.path(probe), b"imagenet-dp")
            self.root.fs.rm_file(self.root.path(probe))
        except request_errors() as error:
            raise UserError(f"--output-dir: cannot write {self.describe()} "
                            f"({refusal(error)}); check that the bucket exists and that the "
                            "credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID, ...) may write "
                            "to it") from None


def refusal(error: BaseException) -> str:
    """What a failed request says, in one short line (403 and missing buckets by name)."""
    failed = failure(error)
    prefix = {DENIED: "403 access denied: ", MISSING: "no such bucket or key: "}.get(failed.kind)
    return prefix + failed.said if prefix else failed.words

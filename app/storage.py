"""A dataset's root folder on any fsspec filesystem (local path, file://, s3://, memory://, ...).

The one place that turns a URL into a filesystem: everything below the catalog (tables, readers,
pre-flight checks) reads through a DatasetRoot and never sees credentials or URLs' options.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field
from typing import Any

from app.errors import UserError

DEFAULT_CONCURRENCY = 64  # requests in flight per loader process


@dataclass(frozen=True)
class DatasetRoot:
    """A dataset's root folder on some filesystem. Picklable: the filesystem object itself is
    created lazily in each process that uses it (fsspec/s3fs clients must not cross a fork)."""

    name: str
    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    image_size: int = 0  # the dataset's natural training resolution (0: unknown)
    options: dict[str, Any] = field(default_factory=dict)  # reader options (cache, concurrency)

    @property
    def fs(self):
        return _filesystem(self.url, self.storage_options)[0]

    @property
    def root(self) -> str:
        return _filesystem(self.url, self.storage_options)[1]

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    def path(self, relative: str) -> str:
        return posixpath.join(self.root, relative)

    def exists(self, relative: str = "") -> bool:
        return self.fs.exists(self.path(relative) if relative else self.root)

    def read_bytes(self, relative: str) -> bytes:
        return self.fs.cat_file(self.path(relative))

    def read_text(self, relative: str) -> str:
        return self.read_bytes(relative).decode("utf-8")

    def find(self, relative: str) -> list[str]:
        """All files below `relative`, as paths relative to the root."""
        base = self.path(relative)
        return [posixpath.relpath(p, self.root) for p in self.fs.find(base)]

    def describe(self, relative: str = "") -> str:
        return self.url.rstrip("/") + ("/" + relative if relative else "")


_FILESYSTEMS: dict = {}


def _filesystem(url: str, options: dict[str, Any]):
    """One filesystem per (url, options, process): created after fork/spawn, never inherited."""
    key = (url, repr(sorted(options.items())), os.getpid())
    if key not in _FILESYSTEMS:
        import fsspec  # noqa: PLC0415 (s3fs and friends load only for their protocol)
        # s3fs takes its retry count as an attribute, not as a constructor argument.
        arguments = {k: v for k, v in options.items() if k != "retries"}
        try:
            _FILESYSTEMS[key] = fsspec.core.url_to_fs(url, **arguments)
            if "retries" in options:
                _FILESYSTEMS[key][0].retries = options["retries"]
        except ImportError as error:
            raise UserError(f"cannot open {url}: {error}; install the package it names") from None
        except ValueError as error:
            raise UserError(f"cannot open {url}: {error}") from None
    return _FILESYSTEMS[key]


def _protocols(fs) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)

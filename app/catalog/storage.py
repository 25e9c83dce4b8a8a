"""A dataset's root folder or any other location at a local path or fsspec URL, and its clients:
the one place that turns a URL into clients, so nothing below the catalog sees credentials or
clients' options. Listing and tables go through fsspec (obstore's adapter for gs:// and az://),
object stores' per-image GETs through obstore unless the entry says `reader = "s3fs"`.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.catalog.retry import OBSTORE_RETRY, S3FS_RETRIES
from app.runtime.errors import UserError

DEFAULT_CONCURRENCY = 64  # requests in flight per loader process
DEFAULT_CACHE_GB = 50.0  # an entry's cache_max_gb: its cache folder's bound
FILE_LAYOUTS = ("kaggle", "imagefolder")  # one file per image
SHARD_LAYOUTS = ("wds", "parquet")  # many images per file (app/catalog/shards.py)
LAYOUTS = FILE_LAYOUTS + SHARD_LAYOUTS
# URL schemes obstore reads, by store; the s3fs reader reads only S3.
OBJECT_STORE_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "az": "azure", "abfs": "azure",
                        "abfss": "azure", "adl": "azure", "azure": "azure"}
READERS = ("obstore", "s3fs")

OBJECT_STORE_TIMEOUTS = {"connect_timeout": "5s", "timeout": "30s"}  # no request waits forever


class Location:
    """Anything at a local path or fsspec URL, and its clients. Picklable: the clients are made
    lazily in each process that uses them (they must not cross a fork)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 store_options: dict[str, Any] | None = None):
        self.url = url
        self.storage_options = storage_options or {}  # fsspec (s3fs) options
        self.store_options = store_options or {}  # obstore: endpoint, region, ...

    @property
    def fs(self):
        return _filesystem(self.url, self.storage_options, self.store_options)[0]

    @property
    def root(self) -> str:
        return _filesystem(self.url, self.storage_options, self.store_options)[1]

    @property
    def is_local(self) -> bool:
        protocol = self.fs.protocol  # a name, or a tuple of them
        return "file" in ((protocol,) if isinstance(protocol, str) else protocol)

    @property
    def reader(self) -> str:
        """Who reads whole files: fsspec (a dataset's entry may choose obstore, DatasetRoot)."""
        return "fsspec"

    @property
    def store(self):
        """The obstore client of this root's URL (its prefix included), for this process."""
        return _object_store(self.url, self.store_options)

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
        return [self._relative(p) for p in self.fs.find(self.path(relative))]

    def _relative(self, listed: str) -> str:
        """Not normalised: a listed name with '..' stays visible to the tables' checks instead
        of turning into another path."""
        prefix = self.root.rstrip("/") + "/"
        listed = listed.rstrip("/")
        return listed[len(prefix):] if listed.startswith(prefix) else posixpath.relpath(
            listed, self.root)

    def describe(self, relative: str = "") -> str:
        return self.url.rstrip("/") + ("/" + relative if relative else "")


@dataclass(frozen=True)
class DatasetRoot(Location):
    """A dataset's root folder, named as in the catalog, with how its images are read."""

    name: str
    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec (s3fs) options
    image_size: int = 0  # the dataset's natural training resolution (0: unknown)
    options: dict[str, Any] = field(default_factory=dict)  # reader: cache, concurrency, reader
    layout: str = "kaggle"  # how the tables are found: LAYOUTS
    store_options: dict[str, Any] = field(default_factory=dict)  # obstore: endpoint, region, ...

    @property
    def reader(self) -> str:
        """Who reads the images: "obstore" or "s3fs" for object stores, "fsspec" otherwise."""
        if scheme_of(self.url) not in OBJECT_STORE_SCHEMES:
            return "fsspec"
        return self.options.get("reader", "obstore")

    def find_with_folders(self, relative: str) -> tuple[list[str], list[str]]:
        """(files, folders) below `relative`; empty folders only where the filesystem has any."""
        files, folders = [], []
        for name, info in self.fs.find(self.path(relative), withdirs=True, detail=True).items():
            (folders if info["type"] == "directory" else files).append(self._relative(name))
        return sorted(files), sorted(folders)

    def read_many(self, paths: list[str], concurrency: int) -> dict[str, bytes | BaseException]:
        """Each file's bytes, or its read's error, by one batched fsspec `cat`."""
        fs = self.fs
        full = {fs._strip_protocol(self.path(p)): p for p in paths}  # noqa: SLF001 (cat's keys)
        options = {"batch_size": concurrency} if getattr(fs, "async_impl", False) else {}
        out = fs.cat(list(full), on_error="return", **options)
        if not isinstance(out, dict):  # a single path comes back as its bytes
            out = {next(iter(full)): out}
        return {path: out.get(key, FileNotFoundError(path)) for key, path in full.items()}


def default_cache_dir() -> Path:
    """Where samples and fetched files go unless an entry says `cache_dir`."""
    env = os.environ.get("IMAGENET_DP_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "imagenet-dp"


def url_folder(url: str, kind: str, cache: str | Path | None = None) -> Path:
    """<cache>/<kind>/<16 hex digits of the URL's sha256>/: the one folder of this machine for
    what comes from `url` (a fetched file, a run folder's staging, a dataset's read images), so
    two URLs never share one (`cache`: an entry's `cache_dir`, else the default)."""
    base = Path(cache).expanduser() if cache else default_cache_dir()
    return base / kind / hashlib.sha256(url.encode()).hexdigest()[:16]


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


_FILESYSTEMS: dict = {}
_STORES: dict = {}


def _filesystem(url: str, options: dict[str, Any], store_options: dict[str, Any]):
    """One filesystem per (url, options, process): created after fork/spawn, never inherited."""
    key = (url, repr(sorted(options.items())), repr(sorted(store_options.items())), os.getpid())
    if key not in _FILESYSTEMS:
        _FILESYSTEMS[key] = _open_filesystem(url, options, store_options)
    return _FILESYSTEMS[key]


def _open_filesystem(url: str, options: dict[str, Any], store_options: dict[str, Any]):
    import fsspec  # noqa: PLC0415 (s3fs and friends load only for their protocol)
    store = OBJECT_STORE_SCHEMES.get(scheme_of(url))
    if store in ("gcs", "azure"):
        from obstore.fsspec import FsspecStore  # noqa: PLC0415
        settings = _store_settings(scheme_of(url), store_options)
        return FsspecStore(scheme_of(url), **settings), url.split("://", 1)[1].rstrip("/")
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as error:
        raise UserError(f"cannot open {url}: {error}; install the package it names") from None
    except ValueError as error:
        raise UserError(f"cannot open {url}: {error}") from None
    if store == "s3":  # s3fs: an attribute, not an argument
        fs.retries = S3FS_RETRIES
    return fs, root


def _object_store(url: str, store_options: dict[str, Any]):
    key = (url, repr(sorted(store_options.items())), os.getpid())
    if key not in _STORES:
        from obstore.store import from_url  # noqa: PLC0415
        try:
            _STORES[key] = from_url(url.rstrip("/"), **_store_settings(scheme_of(url),
                                                                       store_options))
        except ValueError as error:  # also obstore's configuration errors
            raise UserError(f"cannot open {url} with obstore: {str(error).splitlines()[0]}"
                            ) from None
    return _STORES[key]


def _store_settings(scheme: str, options: dict[str, Any]) -> dict[str, Any]:
    """obstore keyword arguments from the entry's settings; credentials come from each store's
    own chain (boto3's for AWS, Google's default credentials, Azure's environment), never here."""
    endpoint = options.get("endpoint_url", "")
    client = {**OBJECT_STORE_TIMEOUTS, "allow_http": endpoint.startswith("http://")}
    settings: dict[str, Any] = {"client_options": client, "retry_config": OBSTORE_RETRY}
    config: dict[str, Any] = {"skip_signature": True} if options.get("anon") else {}
    if OBJECT_STORE_SCHEMES.get(scheme) == "s3":
        if endpoint:
            config["endpoint"] = endpoint
        if options.get("region"):
            config["region"] = options["region"]
        if not options.get("anon"):
            settings["credential_provider"] = _aws_credentials(options.get("profile"))
    elif endpoint:  # gs:// and az:// emulators or private endpoints
        config["base_url" if OBJECT_STORE_SCHEMES.get(scheme) == "gcs" else "endpoint"] = endpoint
    settings["config"] = config
    return settings


def _aws_credentials(profile: str | None):
    """boto3's credential chain, the same one s3fs follows, refreshed as it expires."""
    import boto3  # noqa: PLC0415
    import botocore.exceptions  # noqa: PLC0415
    from obstore.auth.boto3 import Boto3CredentialProvider  # noqa: PLC0415
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=profile))
    except botocore.exceptions.ProfileNotFound:
        raise UserError(f"AWS profile '{profile}' not found in ~/.aws/config or "
                        "~/.aws/credentials; check `profile` or AWS_CONFIG_FILE") from None
    except ValueError:  # boto3 found no credentials at all
        raise UserError("no AWS credentials found (environment, profile, ~/.aws, instance "
                        "role); configure them, or set `anon = true` for a public bucket"
                        ) from None

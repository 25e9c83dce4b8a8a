"""datasets.toml -> DatasetRoot: a named dataset opened as a root folder at any fsspec URL. An
entry names existing data (`url`), an archive of it (a `url` ending in .tgz, .tar.gz, .tar or
.zip, with its `sha256` or `md5`) or a sample preset (`sample`), the last two made on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import app.catalog.archive as archive
import app.catalog.sample as sample
from app.catalog.dataset import Dataset
from app.catalog.retry import BOTOCORE_RETRIES, request_errors
from app.catalog.storage import (DEFAULT_CONCURRENCY, LAYOUTS, OBJECT_STORE_SCHEMES, READERS,
                                 SHARD_LAYOUTS, DatasetRoot, Location, default_cache_dir,
                                 scheme_of)
from app.config.tomlfile import read_toml
from app.runtime.errors import UserError, first_line

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Keys an entry may have, with their types; anything else is a typo worth reporting.
ENTRY_KEYS: dict[str, type | tuple[type, ...]] = {
    "url": str, "url_env": str, "sample": str, "seed": int, "image_size": int,
    "region": str, "profile": str, "endpoint_url": str, "anon": bool,
    "cache_dir": str, "cache_max_gb": (int, float), "concurrency": int, "layout": str,
    "reader": str, "train_shards": str, "val_shards": str, "window": int,
    "md5": str, "sha256": str,
}
# What to check when an object store cannot be reached, by store.
CREDENTIAL_HINTS = {
    "s3": "the credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID, ...), `region` and `endpoint_url`",
    "gcs": "the credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default "
           "login) and `endpoint_url`",
    "azure": "the account and credentials (AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY"
             ", managed identity) and `endpoint_url`",
}


@dataclass(frozen=True)
class Catalog:
    path: Path
    entries: dict[str, dict[str, Any]]
    default: str

    @classmethod
    def load(cls, path: str | Path) -> "Catalog":
        path = Path(path)
        if not path.is_absolute() and not path.exists() and (PROJECT_ROOT / path).exists():
            path = PROJECT_ROOT / path  # `datasets.toml` works from any folder
        data = read_toml(path, "dataset catalog")
        entries = data.get("datasets", {})
        if not isinstance(entries, dict) or not entries:
            raise UserError(f"{path}: no [datasets.NAME] entries; add at least one")
        unknown_top = set(data) - {"default", "datasets"}
        if unknown_top:
            raise UserError(f"{path}: unknown top-level key `{sorted(unknown_top)[0]}`; "
                            "expected `default` and [datasets.NAME] tables")
        for name, entry in entries.items():
            _check_entry(path, name, entry)
        default = data.get("default", next(iter(entries)))
        if default not in entries:
            raise UserError(f"{path}: default = '{default}' is not an entry; known: "
                            f"{', '.join(entries)}")
        return cls(path, entries, default)

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def open(self, name: str = "", report: Callable[[str], None] | None = None) -> DatasetRoot:
        """The entry's root, which must exist; generating or downloading it is told to `report`."""
        name = name or self.default
        if name not in self.entries:
            raise UserError(f"unknown dataset '{name}' in {self.path}; known: "
                            f"{', '.join(self.entries)}")
        entry = self.entries[name]
        if "sample" in entry:
            layout = entry.get("layout", "kaggle")
            folder = sample.ensure(entry.get("cache_dir") or sample.default_cache_dir(),
                                   entry["sample"], entry.get("seed", 0), report, layout)
            size = entry.get("image_size", sample.PRESETS[entry["sample"]].image_size)
            return DatasetRoot(name, str(folder), {}, size, layout=layout)
        url = self._url(name, entry)
        if archive.is_archive(url):
            return self._unpacked(name, entry, url, report)
        root = DatasetRoot(name, url, _storage_options(url, entry), entry.get("image_size", 0),
                           _reader_options(entry), entry.get("layout", "kaggle"),
                           _store_options(url, entry))
        try:
            found = root.exists()
            if found and root.reader == "obstore":
                root.store  # noqa: B018 (its configuration and credentials are checked here)
        except request_errors() as error:
            hint = CREDENTIAL_HINTS.get(OBJECT_STORE_SCHEMES.get(scheme_of(url), ""), "the URL")
            raise UserError(f"dataset '{name}': cannot reach {url} "
                            f"({first_line(error, with_type=True)}); check {hint}") from None
        if not found:
            hint = (f"set {entry['url_env']} or " if entry.get("url_env") else "") + \
                f"edit `url` of [datasets.{name}] in {self.path}"
            raise UserError(f"dataset '{name}': root {url} not found; {hint}")
        return root

    def location(self, url: str) -> Location:
        """Any other URL (a run folder, a checkpoint), opened with the settings of the entry in
        the same bucket (the longest matching url wins), else with the credential chains alone."""
        url = url.rstrip("/")
        entry = self._entry_holding(url)
        return Location(url, _storage_options(url, entry), _store_options(url, entry))

    def _entry_holding(self, url: str) -> dict[str, Any]:
        bucket = _bucket_of(url)
        best: tuple[int, dict[str, Any]] = (-1, {})
        for name, entry in self.entries.items():
            if "url" not in entry or not bucket:
                continue
            entry_url = self._url(name, entry).rstrip("/")
            if _bucket_of(entry_url) == bucket:
                shared = len(os.path.commonprefix([entry_url, url]))
                best = max(best, (shared, entry), key=lambda pair: pair[0])
        return best[1]

    def dataset(self, name: str = "") -> Dataset:
        """The entry for the Python API (app/catalog/dataset.py), opened as `open` opens it."""
        return Dataset(self.open(name, report=print))

    def _unpacked(self, name: str, entry: dict[str, Any], url: str,
                  report: Callable[[str], None] | None) -> DatasetRoot:
        where = f"[datasets.{name}] in {self.path}"
        algorithm, digest = archive.checksum_of(where, entry)  # url_env may name the archive
        source = archive.Archive(url, algorithm, digest, where, _storage_options(url, entry))
        folder = archive.ensure(source, entry.get("cache_dir") or default_cache_dir(), report)
        return DatasetRoot(name, str(folder), {}, entry.get("image_size", 0), layout="imagefolder")

    def _url(self, name: str, entry: dict[str, Any]) -> str:
        url = os.environ.get(entry.get("url_env", ""), "") or entry["url"]
        if "://" in url:
            return url
        # Relative local paths are relative to the catalog file, not to where you run from.
        return str((self.path.parent / Path(url).expanduser()).resolve())


def _check_entry(path: Path, name: str, entry: Any) -> None:
    where = f"{path}: [datasets.{name}]"
    if not isinstance(entry, dict):
        raise UserError(f"{where} must be a table")
    for key, value in entry.items():
        if key not in ENTRY_KEYS:
            raise UserError(f"{where}: unknown key `{key}`; known: {', '.join(ENTRY_KEYS)}")
        expected = ENTRY_KEYS[key]
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is int):
            raise UserError(f"{where}: `{key}` has the wrong type ({type(value).__name__})")
    if ("url" in entry) == ("sample" in entry):
        raise UserError(f"{where}: give exactly one of `url` (existing data) or `sample` "
                        f"(generated preset: {', '.join(sample.PRESETS)})")
    if "sample" in entry and entry["sample"] not in sample.PRESETS:
        raise UserError(f"{where}: unknown sample preset '{entry['sample']}'; known: "
                        f"{', '.join(sample.PRESETS)}")
    if entry.get("layout", "kaggle") not in LAYOUTS:
        raise UserError(f"{where}: unknown layout '{entry['layout']}'; known: "
                        f"{', '.join(LAYOUTS)}")
    if "reader" in entry:
        _check_reader(where, entry)
    archive.check_entry(where, entry)
    if entry.get("window", 1) < 1:
        raise UserError(f"{where}: window = {entry['window']}: a window holds at least one "
                        "shard; use 1 or more")
    shard_keys = [key for key in ("train_shards", "val_shards", "window") if key in entry]
    if shard_keys and entry.get("layout", "kaggle") not in SHARD_LAYOUTS:
        raise UserError(f"{where}: `{shard_keys[0]}` is for the shard layouts; set layout = "
                        f"\"{SHARD_LAYOUTS[0]}\" or \"{SHARD_LAYOUTS[1]}\", or remove it")


def _check_reader(where: str, entry: dict[str, Any]) -> None:
    reader, scheme = entry["reader"], scheme_of(entry.get("url", ""))
    if reader not in READERS:
        raise UserError(f"{where}: unknown reader '{reader}'; known: {', '.join(READERS)}")
    store = OBJECT_STORE_SCHEMES.get(scheme)
    if store is None or (reader == "s3fs" and store != "s3"):
        readable = "s3:// URLs" if reader == "s3fs" else "s3://, gs:// and az:// URLs"
        raise UserError(f"{where}: reader = \"{reader}\" reads only {readable}; remove "
                        "`reader` for this url")


def _bucket_of(url: str) -> str:
    """scheme://bucket of an object store's URL; "" for anything else."""
    if scheme_of(url) not in OBJECT_STORE_SCHEMES:
        return ""
    scheme, rest = url.split("://", 1)
    return f"{scheme.lower()}://{rest.split('/', 1)[0]}"


def _storage_options(url: str, entry: dict[str, Any]) -> dict[str, Any]:
    """fsspec options from the entry; never credentials (s3fs follows the AWS chain)."""
    if scheme_of(url) in ("http", "https"):
        return _http_options()
    if not url.startswith(("s3://", "s3a://")):
        return {}
    concurrency = entry.get("concurrency", DEFAULT_CONCURRENCY)
    options: dict[str, Any] = {
        "max_concurrency": 1,  # one GET per object, without a HEAD request first
        "config_kwargs": {
            "max_pool_connections": concurrency,  # botocore's default of 10 would cap it
            "connect_timeout": 10, "read_timeout": 30,  # no request waits forever
            "retries": BOTOCORE_RETRIES,  # app/catalog/retry.py: the one policy
            "response_checksum_validation": "when_required",
        },
    }
    if entry.get("endpoint_url"):
        options["endpoint_url"] = entry["endpoint_url"]
    if entry.get("region"):
        options["client_kwargs"] = {"region_name": entry["region"]}
    if entry.get("profile"):
        options["profile"] = entry["profile"]
    if entry.get("anon"):
        options["anon"] = True
    return options


def _http_options() -> dict[str, Any]:
    """aiohttp's defaults end any request after 5 minutes in all (too short for an archive on a
    slow link) and ignore HTTPS_PROXY: here only a stalled connection fails, and it is honoured."""
    import aiohttp  # noqa: PLC0415 (only where a URL is http's)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)
    return {"client_kwargs": {"timeout": timeout, "trust_env": True}}


def _store_options(url: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The entry's settings for obstore's client (storage.py maps them); never credentials."""
    if scheme_of(url) not in OBJECT_STORE_SCHEMES:
        return {}
    return {key: entry[key] for key in ("endpoint_url", "region", "profile", "anon")
            if key in entry}


def _reader_options(entry: dict[str, Any]) -> dict[str, Any]:
    return {key: entry[key] for key in ("cache_dir", "cache_max_gb", "concurrency", "reader",
                                        "train_shards", "val_shards", "window") if key in entry}

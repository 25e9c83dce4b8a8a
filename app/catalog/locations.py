"""Files and folders named by a local path or any fsspec URL, for what comes after training
(weights, models, images to classify): URLs are opened as run folders are (Catalog.location),
model files at a URL read through the cache (app/catalog/fetcher.py)."""

from __future__ import annotations

import functools
import posixpath
from pathlib import Path

from app.catalog.catalog import Catalog
from app.catalog.fetcher import fetch
from app.catalog.storage import Location, scheme_of
from app.runtime.errors import UserError, first_line

PROJECT_CATALOG = "datasets.toml"  # found from any folder (Catalog.load)
MODELS = "models"  # their kind in the cache: checkpoints, weights, exports


def is_local(location: str) -> bool:
    return not scheme_of(location)


def join(folder: str, name: str) -> str:
    return str(Path(folder) / name) if is_local(folder) else f"{folder.rstrip('/')}/{name}"


@functools.lru_cache(maxsize=1)
def _catalog() -> Catalog | None:
    try:
        return Catalog.load(PROJECT_CATALOG)
    except UserError:  # no catalog, or a broken one: the credential chains alone
        return None


def _root(location: str) -> Location:
    catalog = _catalog()
    if catalog is None or scheme_of(location) in ("", "file", "http", "https"):
        return Location(location.rstrip("/"))
    return catalog.location(location)


def read_cached(location: str) -> bytes:
    """A model file's bytes; at a URL fetched into the cache first (once)."""
    if is_local(location):
        return read_bytes(location)
    return fetch(_root(location), MODELS).read_bytes()


def is_folder(location: str) -> bool:
    if is_local(location):
        return Path(location).is_dir()
    root = _root(location)
    try:
        return root.fs.isdir(root.root)
    except OSError as error:
        raise UserError(f"cannot reach {location}: {first_line(error, 120)}") from None


def files_below(folder: str) -> list[str]:
    """Every file below `folder` (hidden ones left out), sorted, as locations like `folder`."""
    if is_local(folder):
        found = [str(p) for p in Path(folder).rglob("*") if p.is_file()]
    else:
        found = [join(folder, relative) for relative in _root(folder).find("")]
    return sorted(f for f in found if not posixpath.basename(f).startswith("."))


def read_bytes(location: str) -> bytes:
    try:
        if is_local(location):
            return Path(location).read_bytes()
        parent, name = posixpath.split(location)
        return _root(parent).read_bytes(name)
    except FileNotFoundError:
        raise UserError(f"{location} not found") from None
    except IsADirectoryError:
        raise UserError(f"{location} is a folder") from None
    except OSError as error:
        raise UserError(f"cannot read {location}: {first_line(error, 120)}") from None

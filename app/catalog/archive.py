"""A dataset that arrives as one archive (.tgz, .tar.gz, .tar or .zip) at any URL the catalog
reads: fetched by app/catalog/fetcher.py, unpacked by the first run that asks for it (then
removed) into a folder named by its file name and checksum (a changed checksum unpacks anew)
that appears by one rename, so a folder that exists is whole.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from app.catalog.fetcher import (DISK_FULL, Report, cached_path, fetch, format_size, lock,
                                 no_room, say)
from app.catalog.imagefolder import TRAIN_FOLDER, VAL_FOLDER
from app.catalog.storage import Location
from app.runtime.errors import UserError, first_line

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
CHECKSUMS = {"sha256": 64, "md5": 32}  # the entry keys, with their lengths in hex digits
ARCHIVES = "archives"  # their kind in the cache
IGNORED_AT_TOP = ("__MACOSX",)  # zips made on macOS carry it beside their top folder


def is_archive(url: str) -> bool:
    return urlsplit(url).path.lower().endswith(ARCHIVE_SUFFIXES)


def check_entry(where: str, entry: dict[str, Any]) -> None:
    """An archive entry needs one checksum and the ImageFolder layout; a checksum, an archive."""
    if is_archive(entry.get("url", "")):
        checksum_of(where, entry)
        if entry.get("layout", "kaggle") != "imagefolder":
            raise UserError(f"{where}: an archive is unpacked and read in the ImageFolder "
                            "layout (train/<wnid>/, val/<wnid>/); set layout = \"imagefolder\"")
        return
    for key in CHECKSUMS:
        if key in entry:
            raise UserError(f"{where}: `{key}` verifies a downloaded archive, but `url` names "
                            f"none ({', '.join(ARCHIVE_SUFFIXES)}); remove `{key}`")


def checksum_of(where: str, entry: dict[str, Any]) -> tuple[str, str]:
    """(algorithm, hex digest) of an archive entry."""
    given = [key for key in CHECKSUMS if key in entry]
    if not given:
        raise UserError(f"{where}: `url` names an archive; add its checksum, sha256 = \"...\" "
                        "(sha256sum FILE prints it) or md5 = \"...\", so that the download "
                        "is verified")
    if len(given) > 1:
        raise UserError(f"{where}: give one checksum, `sha256` or `md5`, not both")
    key = given[0]
    digest = entry[key].strip().lower()
    if not re.fullmatch(f"[0-9a-f]{{{CHECKSUMS[key]}}}", digest):
        raise UserError(f"{where}: `{key}` must be {CHECKSUMS[key]} hexadecimal digits, got "
                        f"'{entry[key][:80]}'")
    return key, digest


@dataclass(frozen=True)
class Archive:
    """An archive entry: where its bytes are, what they hash to, and where the user edits it."""
    url: str
    algorithm: str  # "sha256" or "md5"
    digest: str
    where: str  # "[datasets.NAME] in PATH": where the user edits the entry
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def file_name(self) -> str:
        return posixpath.basename(urlsplit(self.url).path)

    @property
    def suffix(self) -> str:
        return next(s for s in ARCHIVE_SUFFIXES if self.file_name.lower().endswith(s))

    @property
    def folder_name(self) -> str:
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", self.file_name[:-len(self.suffix)])
        return f"{stem}-{self.digest[:8]}"


def cache_folder(archive: Archive, cache_dir: str | Path) -> Path:
    """Where the archive's dataset is (or will be) unpacked: beside its download."""
    return cached_path(archive.url, ARCHIVES, cache_dir).with_name(archive.folder_name)


def ensure(archive: Archive, cache_dir: str | Path, report: Report = None) -> Path:
    """The unpacked dataset's folder, made first by one process of the machine if need be."""
    target = cache_folder(archive, cache_dir)
    if target.is_dir():
        return target
    with lock(target, archive.url, report, where=archive.where):
        if not target.is_dir():  # unless the process that held the lock before made it
            fetched = fetch(Location(archive.url, archive.storage_options), ARCHIVES,
                            checksum=(archive.algorithm, archive.digest), cache=cache_dir,
                            where=archive.where, report=report)
            unpack_into(archive, fetched, target, report)
    return target


def unpack_into(archive: Archive, fetched: Path, target: Path, report: Report) -> None:
    """Unpack into a staging folder, check the layout, rename into place, remove the archive.
    Staging folders found here are those of killed holders of the lock."""
    for stale in target.parent.glob(f".{target.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    say(report, f"unpacking {archive.file_name} into {target}")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        unpack(archive, fetched, staging)
        os.rename(dataset_folder(archive, staging), target)
    except UserError:  # these bytes will never unpack here: nothing is kept for a next run
        fetched.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    fetched.unlink()


def unpack(archive: Archive, file: Path, staging: Path) -> None:
    try:
        if archive.suffix == ".zip":
            with zipfile.ZipFile(file) as zipped:
                zipped.extractall(staging)  # zipfile drops '..' and leading '/' from names
        else:
            with tarfile.open(file) as tar:
                # "data": no member (or link target) lands outside `staging`, no devices
                tar.extractall(staging, filter="data")
    except tarfile.FilterError as error:
        raise UserError(f"archive {archive.url} holds a member that would land outside its "
                        f"folder ({first_line(error, 120)}); it is not unpacked") from None
    except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error) as error:
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            needs = (f"the archive takes {format_size(file.stat().st_size)} and unpacks to "
                     f"{format_size(unpacked_size(archive, file))}")
            raise no_room(archive.url, staging.parent, error, archive.where, needs) from None
        raise unreadable(archive, error) from None


def unpacked_size(archive: Archive, file: Path) -> int:
    if archive.suffix == ".zip":
        with zipfile.ZipFile(file) as zipped:
            return sum(info.file_size for info in zipped.infolist())
    with tarfile.open(file) as tar:
        return sum(member.size for member in tar)


def dataset_folder(archive: Archive, unpacked: Path) -> Path:
    """The folder holding train/ and val/: the archive's root, or its one top folder."""
    top = sorted(p for p in unpacked.iterdir()
                 if not p.name.startswith(".") and p.name not in IGNORED_AT_TOP)
    for folder in [unpacked] + (top if len(top) == 1 and top[0].is_dir() else []):
        if all(_has_class_folders(folder / split) for split in (TRAIN_FOLDER, VAL_FOLDER)):
            return folder
    held = ", ".join(p.name + ("/" if p.is_dir() else "") for p in top[:6]) or "nothing"
    more = f" and {len(top) - 6} more" if len(top) > 6 else ""
    raise UserError(f"archive {archive.url} holds {held}{more} at its top, not {TRAIN_FOLDER}/ "
                    f"and {VAL_FOLDER}/ with class folders (at its root or under one top "
                    f"folder); point `url` of {archive.where} at an archive in the ImageFolder "
                    "layout")


def _has_class_folders(folder: Path) -> bool:
    return folder.is_dir() and any(p.is_dir() for p in folder.iterdir())


def unreadable(archive: Archive, error: BaseException) -> UserError:
    return UserError(f"{archive.url} is not a readable {archive.suffix} archive "
                     f"({first_line(error, 120, True)}), though its checksum is the catalog's; "
                     f"check `url` and the checksum of {archive.where}")

"""Which version of its source a fetched file is: what the source says of its bytes now (ETag,
generation or modification time, with the size), and what it said when this machine's copy was
made, kept beside the copy in `.<name>.version`. A copy is the source's only while the two
agree and the copy is unchanged here since (a run's staged last.pt is replaced as it trains).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from app.runtime.files import write_atomically

# The keys that name a version in the clients' answers (fsspec's info(), obstore's head() and a
# GET's meta), first found first taken; the same version under any client's spelling. A name
# of the object's bytes (ETag, generation) goes before a time: two writes within a
# timestamp's resolution differ only there.
TAGS = {"ETag": "etag", "e_tag": "etag", "etag": "etag", "generation": "generation",
        "mtime": "mtime", "LastModified": "modified", "last_modified": "modified",
        "Last-Modified": "modified"}


@dataclass(frozen=True)
class Version:
    """What the source says of its file: its size (None if it does not say) and `tag`, its
    ETag, generation or modification time ("" where it says none: a web server without ETag
    or Last-Modified; then the size alone tells a change, as nothing else can)."""
    size: int | None
    tag: str = ""

    @property
    def known(self) -> bool:
        return self.size is not None or bool(self.tag)


def version_of(info: dict) -> Version:
    """The version in a client's answer about a file (a plain local file's: mtime and size)."""
    size = info.get("size")
    for key, name in TAGS.items():
        value = info.get(key)
        if value not in (None, ""):
            if isinstance(value, datetime):  # the same moment, whichever time zone it names
                value = value.timestamp()
            return Version(size, f"{name}:{value}")
    return Version(size)


def sidecar(local: Path) -> Path:
    return local.with_name(f".{local.name}.version")


def is_copy_of(local: Path, version: Version) -> bool:
    """Whether `local` was made from `version` of its source and is unchanged since."""
    entry = _entries(local).get("file")
    return version.known and entry == {**asdict(version), "here": _here(local)}


def part_is_of(local: Path, version: Version) -> bool:
    """Whether the cut download of `local` (its .part) holds bytes of `version`."""
    return version.known and _entries(local).get("part") == asdict(version)


def remember(local: Path, file: Version | None = None, part: Version | None = None) -> None:
    """What `local` (as it is now) and its .part are copies of; None: of nothing known. Written
    atomically, under the file's lock (app/catalog/fetcher.py)."""
    entries = {}
    if file is not None:
        entries["file"] = {**asdict(file), "here": _here(local)}
    if part is not None:
        entries["part"] = asdict(part)
    if entries:
        write_atomically(sidecar(local), json.dumps(entries))
    else:
        sidecar(local).unlink(missing_ok=True)


def _entries(local: Path) -> dict:
    try:
        return json.loads(sidecar(local).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):  # none, or torn by a writer of another program
        return {}


def _here(local: Path) -> list[int] | None:
    """The copy as this machine has it: a file replaced or written to since is another one."""
    try:
        status = os.stat(local)
    except FileNotFoundError:
        return None
    return [status.st_ino, status.st_mtime_ns, status.st_size]

"""`bin/bench.py photos`: real photos brought to a GPU machine without network, in parts small
enough to copy one at a time.

- pack: an ImageFolder re-encoded with its shorter side at N px (app/catalog/shrink.py), dealt
  in order into tars of at most --part-size, one per folder p1, p2, ... beside its manifest.
  --out must be a folder git ignores: photos are never committed. The tars carry no times or
  owners: same photos, same bytes.
- receive, on the GPU machine: each part checked against its manifest and unpacked into the
  copy, whose receipt lists the parts in: a part copied twice is unpacked once, a part of a
  newer pack starts the copy again. The copy is an ImageFolder (the catalog's
  `imagenette_local`), not shards, because the peers of gpu-check's imagenette part read folders."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import subprocess
import tarfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

from app.catalog.imagefolder import IMAGE_SUFFIXES, TRAIN_FOLDER, VAL_FOLDER
from app.catalog.shrink import shrink
from app.runtime.errors import UserError
from app.runtime.files import atomic_path, write_atomically

MANIFEST = "pack.json"
PART_TAR = "photos.tar"
RECEIPT = ".parts.json"
MIB = 2**20
BLOCK = tarfile.BLOCKSIZE  # a member's header, and the unit its data is padded to
RECORD = tarfile.RECORDSIZE  # a whole tar is padded to this
PART = re.compile(r"p\d+")


def photos_of(source: Path) -> list[str]:
    """Every image of the ImageFolder, as split/class/name, in sorted order."""
    found = [f"{split}/{folder.name}/{path.name}"
             for split in (TRAIN_FOLDER, VAL_FOLDER) if (source / split).is_dir()
             for folder in sorted((source / split).iterdir()) if folder.is_dir()
             for path in sorted(folder.iterdir())
             if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES]
    if not any(name.startswith(f"{VAL_FOLDER}/") for name in found) or \
            not any(name.startswith(f"{TRAIN_FOLDER}/") for name in found):
        raise UserError(f"{source}: no photos in train/<class>/ and val/<class>/; give an "
                        "ImageFolder-layout folder")
    return found


def shrunk(job: tuple[Path, int]) -> bytes:
    path, shorter_side = job
    return shrink(path.read_bytes(), shorter_side)


def shrink_all(source: Path, names: list[str], shorter_side: int,
               workers: int) -> Iterator[bytes]:
    """Each photo re-encoded, in order; several processes share the decoding."""
    jobs = [(source / name, shorter_side) for name in names]
    if workers <= 1:
        yield from map(shrunk, jobs)
        return
    with ProcessPoolExecutor(workers) as pool:
        yield from pool.map(shrunk, jobs, chunksize=64)


def member_bytes(size: int) -> int:
    """A photo's share of a tar: a header block, its data padded to blocks."""
    return BLOCK + -(-size // BLOCK) * BLOCK


def tar_bytes(members: int) -> int:
    """A tar's size on disk: its members, two end blocks, the whole padded to a record."""
    return -(-(members + 2 * BLOCK) // RECORD) * RECORD


def deal(names: list[str], sizes: list[int], part_bytes: int) -> list[int]:
    """How many photos, in order, each part holds: as many as a tar of `part_bytes` takes."""
    counts: list[int] = []
    members = 0
    for name, size in zip(names, sizes):
        if tar_bytes(member_bytes(size)) > part_bytes:
            raise UserError(f"{name} is {size:,} bytes re-encoded: more than a part of "
                            f"{part_bytes:,} bytes holds; give a larger --part-size")
        if counts and tar_bytes(members + member_bytes(size)) <= part_bytes:
            counts[-1] += 1
            members += member_bytes(size)
        else:
            counts.append(1)
            members = member_bytes(size)
    return counts


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)  # mtime 0, owner root: same photos, same bytes
    member.size, member.mode = len(data), 0o644
    tar.addfile(member, io.BytesIO(data))


def check_ignored(folder: Path) -> None:
    """Photos are never committed: a folder inside a git work tree must be one git ignores
    (exit 1: not ignored; 128: no work tree here, nothing to commit them to)."""
    where = next(parent for parent in (folder, *folder.parents) if parent.exists())
    try:
        found = subprocess.run(["git", "check-ignore", "-q", str(folder.resolve())], cwd=where,
                               capture_output=True)
    except FileNotFoundError:  # no git: nothing to commit them with
        return
    if found.returncode == 1:
        raise UserError(f"{folder} is not ignored by git, and photos must never be committed: "
                        "pack into an ignored folder (.carry/ is)")


def pack(source: Path, out: Path, shorter_side: int, part_bytes: int, workers: int = 1) -> dict:
    """bin/bench.py photos pack: the photos of `source` re-encoded into parts under `out`."""
    check_ignored(out)
    names = photos_of(source)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():  # an earlier pack's parts, which may have been more
        if old.is_dir() and PART.fullmatch(old.name):
            if not {path.name for path in old.iterdir()} <= {PART_TAR, MANIFEST}:
                raise UserError(f"{old} holds more than a part; pack into another folder")
            shutil.rmtree(old)
    # all in memory: a copy small enough to carry in parts is small enough for that
    photos = list(shrink_all(source, names, shorter_side, workers))
    parts = write_parts(out, names, photos, part_bytes)
    digest = hashlib.sha256("".join(part["sha256"] for part in parts).encode()).hexdigest()
    for number, part in enumerate(parts, 1):
        write_atomically(out / part["folder"] / MANIFEST, json.dumps(
            {"pack": digest[:16], "part": number, "parts": len(parts), **part,
             "shorter_side": shorter_side, "source": str(source)}, indent=1))
    return {"source": str(source), "out": str(out), "shorter_side": shorter_side,
            "pack": digest[:16], "bytes": sum(part["bytes"] for part in parts),
            "photos": {split: sum(name.startswith(f"{split}/") for name in names)
                       for split in (TRAIN_FOLDER, VAL_FOLDER)}, "parts": parts}


def write_parts(out: Path, names: list[str], photos: list[bytes],
                part_bytes: int) -> list[dict]:
    """The photos dealt in order into tars of at most `part_bytes`: p1/photos.tar, ...; each
    part's folder, size, photo count and sha256."""
    parts, first = [], 0
    for number, count in enumerate(deal(names, [len(data) for data in photos], part_bytes), 1):
        folder = out / f"p{number}"
        folder.mkdir()
        with atomic_path(folder / PART_TAR) as temporary:
            with tarfile.open(temporary, "w", format=tarfile.USTAR_FORMAT) as tar:
                for name, data in zip(names[first:first + count], photos[first:first + count]):
                    add_member(tar, name, data)
            written = temporary.read_bytes()
        assert len(written) <= part_bytes, (folder, len(written))  # deal()'s sums are exact
        parts.append({"folder": folder.name, "bytes": len(written), "photos": count,
                      "sha256": hashlib.sha256(written).hexdigest()})
        first += count
    return parts


def manifests(parts: Path) -> list[dict]:
    """The manifests of the parts under `parts` (p1/pack.json, ...), of one pack, in order."""
    found = [dict(json.loads(path.read_text()), folder=path.parent.name)
             for path in sorted(parts.glob(f"p*/{MANIFEST}"))]
    if not found:
        raise UserError(f"no parts under {parts} (p1/{MANIFEST}, ...): copy one there first "
                        "(bin/bench.py photos pack makes them)")
    if len({manifest["pack"] for manifest in found}) > 1:
        raise UserError(f"{parts} holds parts of several packs; keep one pack's parts there")
    return sorted(found, key=lambda manifest: manifest["part"])


def receipt_of(into: Path) -> dict | None:
    path = into / RECEIPT
    return json.loads(path.read_text()) if path.exists() else None


def receive(parts: Path, into: Path) -> dict:
    """bin/bench.py photos receive: the parts found under `parts` unpacked into the copy."""
    receipt = receipt_of(into)
    if receipt is None and into.exists() and any(into.iterdir()):
        raise UserError(f"{into} holds files but no photos received there; receive into a new "
                        "folder")
    for manifest in manifests(parts):
        if receipt is None or receipt["pack"] != manifest["pack"]:  # a new pack: start again
            shutil.rmtree(into, ignore_errors=True)
            receipt = {"pack": manifest["pack"], "parts": manifest["parts"], "received": [],
                       "photos": 0, "shorter_side": manifest["shorter_side"]}
        if manifest["part"] in receipt["received"]:
            continue
        tar = parts / manifest["folder"] / PART_TAR
        if not tar.exists() or hashlib.sha256(tar.read_bytes()).hexdigest() != \
                manifest["sha256"]:
            raise UserError(f"{tar} is not the part its manifest describes (cut short while "
                            "copied?): copy it again")
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tar) as archive:
            archive.extractall(into, filter="data")  # names that leave the copy are refused
        receipt["received"] = sorted(receipt["received"] + [manifest["part"]])
        receipt["photos"] += manifest["photos"]
        write_atomically(into / RECEIPT, json.dumps(receipt, indent=1))
    return {"into": str(into), **receipt, "missing": missing(into)}


def missing(into: Path) -> str:
    """What the copy at `into` lacks, in words; "" when it is whole."""
    receipt = receipt_of(into)
    if receipt is None:
        return (f"no photos at {into}: make the parts with `bin/bench.py photos pack`, copy "
                "them to this machine and run `bin/bench.py photos receive` here")
    lacking = sorted(set(range(1, receipt["parts"] + 1)) - set(receipt["received"]))
    if lacking:
        return (f"the copy at {into} lacks part(s) {', '.join(map(str, lacking))} of "
                f"{receipt['parts']}: copy them here and run `bin/bench.py photos receive`")
    return ""


def format_report(report: dict) -> str:
    if "source" in report:  # pack
        photos = report["photos"]
        lines = [f"{photos['train'] + photos['val']:,} photos (train {photos['train']:,}, val "
                 f"{photos['val']:,}), shorter side {report['shorter_side']} px: "
                 f"{report['bytes'] / MIB:.1f} MiB in {len(report['parts'])} part(s) under "
                 f"{report['out']} (pack {report['pack']})"]
        lines += [f"  {part['folder']}: {part['bytes'] / MIB:.1f} MiB, {part['photos']:,} photos"
                  for part in report["parts"]]
        return "\n".join(lines + [
            "On the GPU machine, copy each part to the same path in the project there, then "
            f"run `python3 bin/bench.py photos receive {report['out']}` (once per part as they "
            "arrive, or once for all)."])
    state = report["missing"] or f"the copy is whole: {report['photos']:,} photos"
    return (f"part(s) {', '.join(map(str, report['received']))} of {report['parts']} received "
            f"into {report['into']}; {state}")

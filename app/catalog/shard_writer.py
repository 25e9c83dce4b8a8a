"""bin/make_shards.py: any catalog entry (Kaggle, ImageFolder; local, S3, any URL) written as
shards in the forms the shard layouts read (app/catalog/shards.py), Hugging Face's own:

- wds: `imagenet1k-{train,validation}-NNNN.tar` and timm's `_info.json`. A sample's KEY is its
  split and place (`train_00001234`): readers cut a member's name at its first dot, so a key
  made from a file name (`photo.2020.jpg`) would split or merge samples;
- parquet: `data/{train,validation}-NNNNN-of-NNNNN.parquet`, with the `datasets` library's
  feature metadata (Image, ClassLabel).

Samples are shuffled across shards with a fixed seed, so every window of shards holds a mix of
classes. The plan (order, samples per shard) is written first: a killed run, started again with
the same arguments, keeps the shards it finished and writes the others.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import tarfile
from pathlib import Path, PurePosixPath

import numpy as np
import pandas as pd
from tqdm import tqdm

from app.catalog.catalog import Catalog
from app.catalog.labels import SYNSET_MAPPING
from app.catalog.shard_index import IMAGE_EXTENSIONS, index_tar
from app.catalog.shards import INFO_FILE, INFO_SPLITS
from app.catalog.shrink import shrink
from app.catalog.storage import SHARD_LAYOUTS, DatasetRoot
from app.catalog.tables import load_tables
from app.runtime.errors import UserError, first_line
from app.runtime.files import atomic_path, remove_temporaries, write_atomically

log = logging.getLogger("imagenet_dp")
PLAN_FILE = ".make_shards.json"
READ_BATCH = 64  # images read at once (concurrently on object stores)
SIZE_PROBE = 256  # images whose mean size sets the samples per shard
Sample = tuple[str, str, bytes, int]  # (key, the source's relative path, bytes, label)
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="make_shards.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder to write the shards into (a local path)")
    parser.add_argument("--dataset", default="", help="catalog entry to read (default: the "
                        "catalog's default)")
    parser.add_argument("--catalog", default="datasets.toml", help="the dataset catalog")
    parser.add_argument("--format", choices=SHARD_LAYOUTS, default="wds",
                        help="wds: timm/imagenet-1k-wds's tars; parquet: imagenet-1k's files")
    parser.add_argument("--shard-size", default="1GB", help="bytes of images per shard "
                        "(e.g. 500MB, 1GB, 1GiB)")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle across shards")
    parser.add_argument("--shorter-side", type=int, default=0, metavar="N", help="re-encode "
                        "each image larger than this with its shorter side at N px (JPEG "
                        "quality 90), as fast.ai's 160/320 px Imagenette: a copy to bring to "
                        "a machine with little disk or bandwidth (0 = the bytes as they are)")
    args = parser.parse_args(argv)
    if args.shorter_side < 0:
        raise UserError(f"--shorter-side {args.shorter_side}: give a size in px, or 0")
    root = Catalog.load(args.catalog).open(args.dataset, report=log.info)
    if root.layout in SHARD_LAYOUTS:
        raise UserError(f"dataset '{root.name}' is already shards ({root.layout}); name an "
                        "entry of files (Kaggle or ImageFolder layout)")
    write_shards(root, Path(args.out), args.format, parse_size(args.shard_size), args.seed,
                 args.shorter_side)
    return 0


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].upper() not in UNITS:
        raise UserError(f"--shard-size {text!r}: expected a number and a unit (KB, MB, GB, "
                        "MiB, GiB), e.g. 1GB")
    return max(1, int(float(match[1]) * UNITS[match[2].upper()]))


def write_shards(root: DatasetRoot, out: Path, layout: str, shard_bytes: int, seed: int,
                 shorter_side: int = 0) -> None:
    tables = load_tables(root)
    out.mkdir(parents=True, exist_ok=True)
    splits = {"train": tables.train, "val": tables.val}
    # shard_bytes counts the source's bytes: with --shorter-side the shards come out smaller
    plan = {"dataset": root.url, "format": layout, "seed": seed, "shard_bytes": shard_bytes,
            **({"shorter_side": shorter_side} if shorter_side else {}),  # older plans match
            "splits": {split: plan_split(root, frame, shard_bytes, seed)
                       for split, frame in splits.items()}}
    check_plan(out, plan)
    for folder in (out, out / "data"):  # a killed run's half-written shard
        for path in remove_temporaries(folder):
            log.info("removed %s, left by a run that was stopped while writing it", path)
    write_atomically(out / SYNSET_MAPPING, "".join(
        f"{wnid} {words}\n" for wnid, words in zip(tables.wnids, tables.descriptions)))
    names = {split: shard_names(layout, split, len(plan["splits"][split]["shards"]))
             for split in splits}
    total = sum(len(frame) for frame in splits.values())
    with tqdm(total=total, unit="img", desc=f"writing {layout} shards") as progress:
        for split, frame in splits.items():
            first = 0  # the shard's first sample's place in the split's order: its keys
            for name, rows in zip(names[split], plan["splits"][split]["shards"]):
                if not (out / name).exists():  # finished by an earlier run: kept
                    keys = [f"{INFO_SPLITS[split]}_{n:08d}"
                            for n in range(first, first + len(rows))]
                    write_shard(root, frame.iloc[rows], keys, out / name, layout, tables.wnids,
                                shorter_side)
                first += len(rows)
                progress.update(len(rows))
    if layout == "wds":
        write_info(out, names)
    log.info("wrote %s shards of '%s' to %s", layout, root.name, out)


def plan_split(root: DatasetRoot, frame: pd.DataFrame, shard_bytes: int, seed: int) -> dict:
    """The split's rows in the seeded order, dealt into shards of about `shard_bytes` (from the
    mean size of the first images of that order)."""
    order = np.random.default_rng(seed).permutation(len(frame))
    probe = [len(data) for data, _ in read_images(root, frame.path.iloc[order[:SIZE_PROBE]])
             if data is not None]
    per_shard = max(1, int(shard_bytes // max(1.0, float(np.mean(probe or [1])))))
    return {"per_shard": per_shard, "shards": [order[i:i + per_shard].tolist()
                                               for i in range(0, len(order), per_shard)]}


def check_plan(out: Path, plan: dict) -> None:
    path = out / PLAN_FILE
    if path.exists() and json.loads(path.read_text()) != plan:
        raise UserError(f"{out} holds shards of another dataset or other arguments "
                        f"({path}); write into an empty folder, or repeat that run's arguments")
    write_atomically(path, json.dumps(plan))


def shard_names(layout: str, split: str, count: int) -> list[str]:
    name = INFO_SPLITS[split]
    if layout == "wds":
        return [f"imagenet1k-{name}-{i:04d}.tar" for i in range(count)]
    return [f"data/{name}-{i:05d}-of-{count:05d}.parquet" for i in range(count)]


def read_images(root: DatasetRoot, paths: pd.Series):
    """(bytes, path) per image, READ_BATCH at a time (concurrent on object stores); (None, path)
    for one that cannot be read."""
    paths = list(paths)
    for first in range(0, len(paths), READ_BATCH):
        batch = paths[first:first + READ_BATCH]
        found = root.read_many(batch, READ_BATCH)
        for path in batch:
            yield (found[path] if isinstance(found[path], bytes) else None), path


def write_shard(root: DatasetRoot, frame: pd.DataFrame, keys: list[str], target: Path,
                layout: str, wnids: list[str], shorter_side: int = 0) -> None:
    samples: list[Sample] = []
    for key, (data, path), label in zip(keys, read_images(root, frame.path), frame.label):
        if data is None:
            log.warning("left out %s: it cannot be read", root.describe(path))
            continue
        samples.append((key, path, shrink(data, shorter_side) if shorter_side else data,
                        int(label)))
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as temporary:
        (write_tar if layout == "wds" else write_parquet)(temporary, samples, wnids)


def write_tar(path: Path, samples: list[Sample], wnids: list[str]) -> None:
    # a key twice, or one with a dot, would merge or split samples in every reader
    assert len({key for key, *_ in samples}) == len(samples), "sample keys must be unique"
    assert not any("." in key or "/" in key for key, *_ in samples), "keys have no . or /"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, source, data, label in samples:
            meta = {"filename": PurePosixPath(source).name, "path": source, "label": label,
                    "wnid": wnids[label]}
            for extension, payload in ((image_extension(source), data),
                                       ("cls", f"{label}".encode()),
                                       ("json", json.dumps(meta).encode())):
                member = tarfile.TarInfo(f"{key}.{extension}")
                member.size, member.mode = len(payload), 0o644
                tar.addfile(member, io.BytesIO(payload))


def image_extension(source: str) -> str:
    """The source's own for an image format webdataset decodes, `jpg` for JPEG (as timm's)."""
    suffix = PurePosixPath(source).suffix.lower().lstrip(".")
    return suffix if suffix in IMAGE_EXTENSIONS and suffix != "jpeg" else "jpg"


def parquet_schema(wnids: list[str]):
    import pyarrow as pa  # noqa: PLC0415
    features = {"image": {"_type": "Image"},
                "label": {"_type": "ClassLabel", "names": list(wnids)}}
    return pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                      ("label", pa.int64())],
                     metadata={"huggingface": json.dumps({"info": {"features": features}})})


def write_parquet(path: Path, samples: list[Sample], wnids: list[str]) -> None:
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415
    table = pa.table({"image": [{"bytes": data, "path": source} for _, source, data, _ in samples],
                      "label": [label for *_, label in samples]}, schema=parquet_schema(wnids))
    # JPEG bytes do not compress; row groups of ~100 images keep a reader's memory small
    pq.write_table(table, path, row_group_size=100, compression="none")


def write_info(out: Path, names: dict[str, list[str]]) -> None:
    splits = {}
    for split, shards in names.items():
        try:
            lengths = [len(index_tar(out / name, str(out / name))) for name in shards]
        except UserError as error:
            raise UserError(f"{first_line(error, 300)}; delete it and run again") from None
        splits[INFO_SPLITS[split]] = {"name": INFO_SPLITS[split], "filenames": shards,
                                      "shard_lengths": lengths, "num_samples": sum(lengths)}
    write_atomically(out / INFO_FILE, json.dumps({"name": "imagenet-1k", "splits": splits},
                                                 indent=1))

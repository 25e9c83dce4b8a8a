"""Foreign shard copies of a Kaggle-layout dataset, written the way Hugging Face's copies are laid
out and with the formats' own libraries (tarfile, pyarrow), not with bin/make_shards.py:

- timm/imagenet-1k-wds: imagenet1k-{train,validation}-NNNN.tar with KEY.jpg, KEY.cls, KEY.json
  per sample, and _info.json listing the splits' shards and their sample counts;
- imagenet-1k (parquet): data/{train,validation}-NNNNN-of-NNNNN.parquet with columns
  image = struct<bytes: binary, path: string> and label: int64.

Samples are shuffled across shards with a fixed seed, as those copies are; the class index is
the source's label (for the tiny sample, ImageNet-1k's first classes: their sorted order)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from app.catalog.storage import DatasetRoot
from app.catalog.tables import load_tables

SPLITS = {"train": "train", "val": "validation"}


NOT_AN_IMAGE = b"<html>403 Forbidden</html>\n"


def rows(source: Path, split: str, shards: int, seed: int = 0, corrupt: int | None = None
         ) -> list[list[tuple[str, bytes, int]]]:
    """(file name, bytes, label) of a split of `source`, shuffled and dealt into `shards`;
    the bytes of the `corrupt`-th train sample (in that order) are not an image."""
    frame = getattr(load_tables(DatasetRoot("source", str(source))), split)
    order = np.random.default_rng(seed).permutation(len(frame))
    samples = [(Path(frame.path[i]).name, (source / frame.path[i]).read_bytes(),
                int(frame.label[i])) for i in order]
    if corrupt is not None and split == "train":
        name, _, label = samples[corrupt]
        samples[corrupt] = (name, NOT_AN_IMAGE, label)
    return [list(part) for part in np.array_split(np.array(samples, dtype=object), shards)]


def write_wds(source: Path, out: Path, train_shards: int = 4, val_shards: int = 2,
              info: bool = True, corrupt: int | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, shards in (("train", train_shards), ("val", val_shards)):
        names, lengths = [], []
        for number, part in enumerate(rows(source, split, shards, corrupt=corrupt)):
            name = f"imagenet1k-{SPLITS[split]}-{number:04d}.tar"
            with tarfile.open(out / name, "w") as tar:
                for file_name, data, label in part:
                    key = file_name.rsplit(".", 1)[0]
                    meta = json.dumps({"filename": file_name, "label": label}).encode()
                    for extension, payload in (("jpg", data), ("cls", str(label).encode()),
                                               ("json", meta)):
                        member = tarfile.TarInfo(f"{key}.{extension}")
                        member.size = len(payload)
                        tar.addfile(member, io.BytesIO(payload))
            names.append(name)
            lengths.append(len(part))
        splits[SPLITS[split]] = {"name": SPLITS[split], "filenames": names,
                                 "shard_lengths": lengths, "num_samples": sum(lengths)}
    if info:
        (out / "_info.json").write_text(json.dumps({"name": "imagenet-1k", "splits": splits}))
    return out


PARQUET_SCHEMA = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                            ("label", pa.int64())])


def write_parquet(source: Path, out: Path, train_shards: int = 4, val_shards: int = 2,
                  row_group_size: int = 40, corrupt: int | None = None) -> Path:
    (out / "data").mkdir(parents=True, exist_ok=True)
    for split, shards in (("train", train_shards), ("val", val_shards)):
        for number, part in enumerate(rows(source, split, shards, corrupt=corrupt)):
            table = pa.table({
                "image": [{"bytes": data, "path": file_name} for file_name, data, _ in part],
                "label": [label for _, _, label in part]}, schema=PARQUET_SCHEMA)
            name = f"{SPLITS[split]}-{number:05d}-of-{shards:05d}.parquet"
            pq.write_table(table, out / "data" / name, row_group_size=row_group_size)
    return out

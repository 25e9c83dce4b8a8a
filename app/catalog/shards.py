"""The shard layouts -> labelled frames: ImageNet as Hugging Face publishes it, `wds` (WebDataset
tars as timm/imagenet-1k-wds, with `_info.json` giving each split's shards and sample counts) and
`parquet` (imagenet-1k's files: columns `image` = struct<bytes, path> and `label`).

A frame has a row per sample, grouped by shard in split order: `path` is `SHARD#N` (from 0: what
skipped.tsv names), `shard` the shard's position, `label` the selected class's index, or -1 where
the shard's is still to be read (every class is selected: the shard's index is the label).
Labels are read ahead of training only where cheap or needed: a parquet file's `label` column
always; a tar's `.cls` members (fetching a remote shard) only when no `_info.json` gives the
counts or `--classes` selects a subset.
"""

from __future__ import annotations

import json
from typing import Callable

import numpy as np
import pandas as pd

import app.catalog.imagenet_classes as imagenet_classes
from app.catalog.labels import SYNSET_MAPPING, Classes, ClassIndex, Tables, read_synset_mapping
from app.catalog.shard_index import ShardError, missing_shard, parquet_labels
from app.catalog.shard_store import ShardStore
from app.catalog.storage import DatasetRoot
from app.runtime.errors import UserError

DEFAULT_SHARDS = {
    "wds": {"train": "imagenet1k-train-*.tar", "val": "imagenet1k-validation-*.tar"},
    "parquet": {"train": "data/train-*.parquet", "val": "data/validation-*.parquet"},
}
INFO_FILE = "_info.json"
INFO_SPLITS = {"train": "train", "val": "validation"}  # our split -> the info file's


def load_tables(root: DatasetRoot, classes: Classes = 0,
                report: Callable[[str], None] | None = None) -> Tables:
    index = class_index(root, classes)
    everything = len(index.wnids) == len(index.known)
    info = read_info(root) if root.layout == "wds" else {}
    frames = [split_frame(root, split, index, info.get(INFO_SPLITS[split]), everything, report)
              for split in ("train", "val")]
    return Tables(*frames, index.wnids, index.descriptions)


def class_index(root: DatasetRoot, classes: Classes = 0) -> ClassIndex:
    """The shard's class indices name the classes of the root's LOC_synset_mapping.txt, in
    its order, or else ImageNet-1k's; `classes` selects among them."""
    if isinstance(classes, ClassIndex):
        return classes
    if root.exists(SYNSET_MAPPING):
        mapping = read_synset_mapping(root)
        known, words, source = list(mapping.wnid), list(mapping.description), \
            root.describe(SYNSET_MAPPING)
    else:
        known, words = imagenet_classes.wnids_and_words()
        source = "ImageNet-1k's classes"
    return ClassIndex.select(known, words, classes, source, tuple(known))


def shard_names(root: DatasetRoot, split: str, info_split: dict | None) -> list[str]:
    """The split's shards in order: the entry's pattern, else the info file's list, else the
    default pattern of the layout."""
    pattern = root.options.get(f"{split}_shards", "")
    if not pattern and info_split and info_split.get("filenames"):
        return list(info_split["filenames"])
    pattern = pattern or DEFAULT_SHARDS[root.layout][split]
    prefix = root.root.rstrip("/") + "/"
    names = sorted(path[len(prefix):] if path.startswith(prefix) else path
                   for path in root.fs.glob(root.path(pattern)))
    if not names:
        raise UserError(f"dataset '{root.name}': no {split} shards match {pattern} at "
                        f"{root.describe()}; set `{split}_shards` in its entry to a glob "
                        "pattern of its shards, relative to `url`")
    return names


def read_info(root: DatasetRoot) -> dict:
    """timm's `_info.json` ({"splits": {"train": {"filenames": [...], "shard_lengths": [...],
    ...}}}), or {} where there is none."""
    if not root.exists(INFO_FILE):
        return {}
    try:
        info = json.loads(root.read_text(INFO_FILE))
        return {name: split for name, split in info["splits"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise UserError(f"{root.describe(INFO_FILE)}: not timm's info file ({error!r}: "
                        "expected {\"splits\": {\"train\": {\"filenames\": [...], "
                        "\"shard_lengths\": [...]}}}); fix or remove it") from None


def split_frame(root: DatasetRoot, split: str, index: ClassIndex, info_split: dict | None,
                everything: bool, report: Callable[[str], None] | None) -> pd.DataFrame:
    names = shard_names(root, split, info_split)
    counts = info_counts(names, info_split) if root.layout == "wds" and everything else None
    raw = shard_labels(root, names, report) if counts is None else \
        [np.full(count, -1, dtype=np.int64) for count in counts]
    frame = pd.DataFrame({
        "path": [f"{name}#{n}" for name, labels in zip(names, raw) for n in range(len(labels))],
        "shard": np.repeat(np.arange(len(names)), [len(labels) for labels in raw]),
        "raw": np.concatenate(raw) if raw else np.empty(0, dtype=np.int64)})
    check_class_indices(root, frame, index, names)
    selected = {wnid: label for label, wnid in enumerate(index.wnids)}
    relabel = np.array([selected.get(wnid, -2) for wnid in index.order] + [-1])
    frame["label"] = relabel[frame.raw.to_numpy()]  # raw -1 (unread) stays -1
    frame = frame[frame.label != -2]
    if frame.empty:
        raise UserError(f"{root.describe()}: no {split} samples of the selected classes; "
                        "check `classes` and the shards' class indices")
    return frame[["path", "label", "shard"]].reset_index(drop=True)


def info_counts(names: list[str], info_split: dict | None) -> list[int] | None:
    """Each shard's sample count from the info file, when it lists every one of them."""
    if not info_split:
        return None
    lengths = dict(zip(info_split.get("filenames", ()), info_split.get("shard_lengths", ())))
    return [int(lengths[name]) for name in names] if all(n in lengths for n in names) else None


def shard_labels(root: DatasetRoot, names: list[str], report: Callable[[str], None] | None
                 ) -> list[np.ndarray]:
    if root.layout == "parquet":
        labels = []
        for name in names:
            try:
                with root.fs.open(root.path(name), "rb") as handle:
                    labels.append(parquet_labels(handle, root.describe(name)))
            except FileNotFoundError:  # listed a moment ago: removed since
                raise missing_shard(root.describe(name)) from None
        return labels
    store = ShardStore(root)
    todo = [name for name in names if not store.ready(name)]
    if todo and report:
        report(f"reading the sample lists of {len(todo)} shards of {root.describe()} once "
               f"(kept in {store.folder})")
    labels = []
    for name in names:
        labels.append(store.open(name).index.labels)
        store.evict(keep=set())
    return labels


def check_class_indices(root: DatasetRoot, frame: pd.DataFrame, index: ClassIndex,
                        names: list[str]) -> None:
    bad = (frame.raw < -1) | (frame.raw >= len(index.order))
    if bad.any():
        row = frame[bad].iloc[0]
        raise ShardError(f"shard {root.describe(names[row.shard])}: sample {row.path} has class "
                         f"index {row.raw}, outside 0..{len(index.order) - 1} of "
                         f"{SYNSET_MAPPING if root.exists(SYNSET_MAPPING) else 'ImageNet-1k'}")

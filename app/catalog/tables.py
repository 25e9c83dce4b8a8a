"""Dataset tables -> labelled frames [path relative to the root, label] for any layout: Kaggle's
here (labels in LOC_synset_mapping.txt's order, every ImageNet model's), the others in
imagefolder.py and shards.py. Every path is checked to stay inside the root before any read.
"""

from __future__ import annotations

import io
import re

import pandas as pd

import app.catalog.imagefolder as imagefolder
import app.catalog.shards as shards
from app.catalog.labels import (SAFE_ID, SAFE_NAME, SYNSET_MAPPING, Classes, ClassIndex, Tables,
                                check_listed, finish, parse_synset_mapping, read_text)
from app.catalog.storage import SHARD_LAYOUTS, DatasetRoot
from app.runtime.errors import UserError

# The Kaggle layout (kaggle competitions download -c imagenet-object-localization-challenge)
TRAIN_DIR = "ILSVRC/Data/CLS-LOC/train"
VAL_DIR = "ILSVRC/Data/CLS-LOC/val"
TRAIN_CLS = "ILSVRC/ImageSets/CLS-LOC/train_cls.txt"
TRAIN_SOLUTION = "LOC_train_solution.csv"
VAL_SOLUTION = "LOC_val_solution.csv"

IMAGENET_TRAIN_IMAGES = 1_281_167
SAFE_CLS_ENTRY = re.compile(rf"^{SAFE_NAME}/{SAFE_NAME}$")
IMAGE_SUFFIX = ".JPEG"
SOLUTION_COLUMNS = ["ImageId", "PredictionString"]


def load_tables(root: DatasetRoot, classes: Classes = 0, train_index: str = "cls") -> Tables:
    """The labelled train and val frames, whatever the layout (`train_index`: Kaggle's list)."""
    if root.layout == "imagefolder":
        return imagefolder.load_tables(root, classes)
    if root.layout in SHARD_LAYOUTS:
        return shards.load_tables(root, classes)
    index = class_index(root, classes)
    notes = []
    if train_index == "csv":
        train = train_solutions(root, TRAIN_SOLUTION, index)
        notes.append(f"train index {TRAIN_SOLUTION} lists only the images with boxes "
                     f"({len(train)} here; about 42% of ImageNet's {IMAGENET_TRAIN_IMAGES:,}); "
                     "use train_index = \"cls\" for the full train set")
    elif train_index == "cls":
        train = train_cls_list(root, index)
    else:
        train = train_listing(root, index)
    val = val_solutions(root, VAL_SOLUTION, index)
    return Tables(train, val, index.wnids, index.descriptions, tuple(notes))


def class_index(root: DatasetRoot, classes: Classes = 0) -> ClassIndex:
    if isinstance(classes, ClassIndex):
        return classes
    mapping = synset_mapping(root)
    return ClassIndex.select(list(mapping.wnid), list(mapping.description), classes,
                             root.describe(SYNSET_MAPPING))


def synset_mapping(root: DatasetRoot) -> pd.DataFrame:
    """Frame [wnid, description] in file order (= label order)."""
    return parse_synset_mapping(_read_table(root, SYNSET_MAPPING), root.describe(SYNSET_MAPPING))


def train_solutions(root: DatasetRoot, table: str = TRAIN_SOLUTION, classes: Classes = 0
                    ) -> pd.DataFrame:
    """The train images listed in the LOC CSV (only those with boxes)."""
    frame = _solutions(root, table, class_index(root, classes))
    folders = frame.ImageId.str.split("_").str[0]  # n01440764_10026 is in train/n01440764/
    bad = ~frame.ImageId.str.contains("_") | ~folders.str.match(SAFE_ID)
    if bad.any():
        row = frame[bad].iloc[0]
        raise UserError(f"{root.describe(table)} line {row.line}: ImageId {row.ImageId[:80]!r} "
                        "is not '<wnid>_<number>' (its folder would be empty or leave train/); "
                        "fix or remove the row")
    frame["path"] = TRAIN_DIR + "/" + folders + "/" + frame.ImageId + IMAGE_SUFFIX
    return finish(frame, root.describe(table))


def val_solutions(root: DatasetRoot, table: str = VAL_SOLUTION, classes: Classes = 0
                  ) -> pd.DataFrame:
    frame = _solutions(root, table, class_index(root, classes))
    frame["path"] = VAL_DIR + "/" + frame.ImageId + IMAGE_SUFFIX
    return finish(frame, root.describe(table))


def train_cls_list(root: DatasetRoot, classes: Classes = 0) -> pd.DataFrame:
    """All train images, from ImageSets/CLS-LOC/train_cls.txt ('<wnid>/<image id> <n>' lines)."""
    text = _read_table(root, TRAIN_CLS, hint='or set train_index = "csv" or "listing"')
    entries = pd.Series([line.split(" ", 1)[0] for line in text.splitlines()], dtype=str)
    lines = pd.Series(range(1, len(entries) + 1))
    keep = entries != ""
    entries, lines = entries[keep], lines[keep]
    bad = ~entries.str.match(SAFE_CLS_ENTRY)
    if bad.any():
        first = bad.idxmax()
        raise UserError(f"{root.describe(TRAIN_CLS)} line {lines[first]}: entry "
                        f"{entries[first][:80]!r} is not '<wnid>/<image id>' or would escape "
                        "the dataset root")
    wnid = entries.str.split("/").str[0]
    frame = pd.DataFrame({"wnid": wnid, "path": TRAIN_DIR + "/" + entries + IMAGE_SUFFIX,
                          "line": lines})
    return finish(_label_rows(frame, root, TRAIN_CLS, classes), root.describe(TRAIN_CLS))


def train_listing(root: DatasetRoot, classes: Classes = 0) -> pd.DataFrame:
    """All train images, by listing the class folders (slow on object stores)."""
    if not root.exists(TRAIN_DIR):
        raise UserError(f"dataset '{root.name}': folder {root.describe(TRAIN_DIR)} not found")
    paths = pd.Series(sorted(p for p in root.find(TRAIN_DIR)
                             if not p.rsplit("/", 1)[-1].startswith(".")), dtype=str)
    check_listed(paths, root.describe(TRAIN_DIR))
    frame = pd.DataFrame({"wnid": paths.str.split("/").str[-2], "path": paths, "line": 0})
    return finish(_label_rows(frame, root, TRAIN_DIR, classes), root.describe(TRAIN_DIR))


def _solutions(root: DatasetRoot, table: str, index: ClassIndex) -> pd.DataFrame:
    """Rows of a LOC solution CSV for the selected classes, with wnid and CSV line number."""
    text = _read_table(root, table)
    try:
        frame = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as error:
        raise UserError(f"{root.describe(table)}: not a readable CSV ({str(error).strip()})"
                        ) from None
    if list(frame.columns[:2]) != SOLUTION_COLUMNS:
        raise UserError(f"{root.describe(table)}: expected columns "
                        f"{','.join(SOLUTION_COLUMNS)}, found {','.join(map(str, frame.columns))}")
    frame["line"] = range(2, len(frame) + 2)  # line 1 is the header
    bad = ~frame.ImageId.str.match(SAFE_ID)
    if bad.any():
        row = frame[bad].iloc[0]
        raise UserError(f"{root.describe(table)} line {row.line}: ImageId {row.ImageId[:80]!r} "
                        "is not a plain file name (it would escape the dataset root); "
                        "fix or remove the row")
    frame["wnid"] = frame.PredictionString.str.split(" ", n=1).str[0]
    return _label_rows(frame, root, table, index)


def _label_rows(frame: pd.DataFrame, root: DatasetRoot, table: str, classes: Classes
                ) -> pd.DataFrame:
    """Check every wnid against the full mapping, keep the selected classes, add labels."""
    index = class_index(root, classes)
    unknown = ~frame.wnid.isin(index.known)
    if unknown.any():
        row = frame[unknown].iloc[0]
        where = f" line {row.line}" if row.line else f" ({row.path})"
        raise UserError(f"{root.describe(table)}{where}: wnid {row.wnid!r} is not in "
                        f"{SYNSET_MAPPING}; fix the row or the mapping")
    labels = {w: i for i, w in enumerate(index.wnids)}
    frame = frame[frame.wnid.isin(labels)].copy()
    frame["label"] = frame.wnid.map(labels).astype("int64")
    return frame


def _read_table(root: DatasetRoot, table: str, hint: str = "") -> str:
    if not root.exists(table):
        raise UserError(f"dataset '{root.name}': table {table} not found at "
                        f"{root.describe(table)}; is this a Kaggle-layout ImageNet? {hint}")
    return read_text(root, table)

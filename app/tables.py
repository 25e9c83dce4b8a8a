"""Kaggle ImageNet tables -> labelled frames of (path relative to the root, label).

Labels follow the order of LOC_synset_mapping.txt (restricted to the selected classes), which
is the order every ImageNet model's class index uses. Every path is checked to stay inside the
dataset root before anything is read.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import pandas as pd

from app.errors import UserError
from app.storage import DatasetRoot

# The Kaggle layout (kaggle competitions download -c imagenet-object-localization-challenge).
TRAIN_DIR = "ILSVRC/Data/CLS-LOC/train"
VAL_DIR = "ILSVRC/Data/CLS-LOC/val"
TRAIN_CLS = "ILSVRC/ImageSets/CLS-LOC/train_cls.txt"
SYNSET_MAPPING = "LOC_synset_mapping.txt"
TRAIN_SOLUTION = "LOC_train_solution.csv"
VAL_SOLUTION = "LOC_val_solution.csv"

IMAGENET_TRAIN_IMAGES = 1_281_167
# File names in the tables: letters, digits, '_', '-', '.'; never '..', '/' or a scheme.
SAFE_NAME = r"(?!\.\.?$)[A-Za-z0-9_.\-]+"
SAFE_ID = re.compile(rf"^{SAFE_NAME}$")
SAFE_CLS_ENTRY = re.compile(rf"^{SAFE_NAME}/{SAFE_NAME}$")
IMAGE_SUFFIX = ".JPEG"
SOLUTION_COLUMNS = ["ImageId", "PredictionString"]


@dataclass(frozen=True)
class Tables:
    """What training needs from a dataset: the two labelled frames and the class names."""
    train: pd.DataFrame
    val: pd.DataFrame
    wnids: list[str]
    descriptions: list[str]
    notes: tuple[str, ...] = ()  # warnings worth showing the user; the caller decides how

    @property
    def num_classes(self) -> int:
        return len(self.wnids)


@dataclass(frozen=True)
class ClassIndex:
    """The synset mapping and the selected classes; label = position in `wnids`."""
    known: frozenset[str]
    wnids: list[str]
    descriptions: list[str]


Classes = int | list[str] | ClassIndex  # a count (0 = all), wnids, or an index built already


def load_tables(root: DatasetRoot, classes: Classes = 0, train_index: str = "cls") -> Tables:
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
    wnids = select_classes(mapping, classes, root)
    descriptions = dict(zip(mapping.wnid, mapping.description))
    return ClassIndex(frozenset(mapping.wnid), wnids, [descriptions[w] for w in wnids])


def synset_mapping(root: DatasetRoot) -> pd.DataFrame:
    """Frame [wnid, description] in file order (= label order)."""
    text = _read_table(root, SYNSET_MAPPING)
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        wnid, _, description = line.strip().partition(" ")
        if not SAFE_ID.match(wnid):
            raise UserError(f"{root.describe(SYNSET_MAPPING)} line {number}: expected "
                            f"'<wnid> <description>', got {line[:60]!r}")
        rows.append((wnid, description.strip()))
    mapping = pd.DataFrame(rows, columns=["wnid", "description"])
    duplicated = mapping.wnid[mapping.wnid.duplicated()]
    if len(duplicated):
        raise UserError(f"{root.describe(SYNSET_MAPPING)}: wnid {duplicated.iloc[0]} is listed "
                        "twice; each class must appear once")
    if mapping.empty:
        raise UserError(f"{root.describe(SYNSET_MAPPING)}: no classes listed")
    return mapping


def select_classes(mapping: pd.DataFrame, classes: int | list[str], root: DatasetRoot
                   ) -> list[str]:
    """The selected wnids in mapping order: all (0), the first N, or a named list."""
    known = list(mapping.wnid)
    if isinstance(classes, int):
        if classes > len(known):
            raise UserError(f"classes = {classes}, but {root.describe(SYNSET_MAPPING)} lists "
                            f"only {len(known)}; choose at most {len(known)}")
        return known[:classes] if classes else known
    if not classes:
        raise UserError("classes is an empty list: it selects no classes; give wnids or a count")
    unknown = [w for w in classes if w not in set(known)]
    if unknown:
        raise UserError(f"class {unknown[0]} is not in {root.describe(SYNSET_MAPPING)}; "
                        "check the wnid")
    chosen = set(classes)
    return [w for w in known if w in chosen]


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
    return _finish(frame, root, table)


def val_solutions(root: DatasetRoot, table: str = VAL_SOLUTION, classes: Classes = 0
                  ) -> pd.DataFrame:
    frame = _solutions(root, table, class_index(root, classes))
    frame["path"] = VAL_DIR + "/" + frame.ImageId + IMAGE_SUFFIX
    return _finish(frame, root, table)


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
    return _finish(_label_rows(frame, root, TRAIN_CLS, class_index(root, classes)), root,
                   TRAIN_CLS)


def train_listing(root: DatasetRoot, classes: Classes = 0) -> pd.DataFrame:
    """All train images by listing the class folders (slow on object stores: one LIST per
    1,000 objects)."""
    if not root.exists(TRAIN_DIR):
        raise UserError(f"dataset '{root.name}': folder {root.describe(TRAIN_DIR)} not found")
    paths = pd.Series(sorted(p for p in root.find(TRAIN_DIR)
                             if not p.rsplit("/", 1)[-1].startswith(".")), dtype=str)
    parts = paths.str.split("/")
    frame = pd.DataFrame({"wnid": parts.str[-2], "path": paths, "line": 0})
    return _finish(_label_rows(frame, root, TRAIN_DIR, class_index(root, classes)), root,
                   TRAIN_DIR)


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


def _label_rows(frame: pd.DataFrame, root: DatasetRoot, table: str, index: ClassIndex
                ) -> pd.DataFrame:
    """Check every wnid against the full mapping, keep the selected classes, add labels."""
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


def _finish(frame: pd.DataFrame, root: DatasetRoot, table: str) -> pd.DataFrame:
    if frame.empty:
        raise UserError(f"{root.describe(table)}: no images for the selected classes; "
                        "check `classes` and the table")
    return frame[["path", "label"]].reset_index(drop=True)


def _read_table(root: DatasetRoot, table: str, hint: str = "") -> str:
    if not root.exists(table):
        raise UserError(f"dataset '{root.name}': table {table} not found at "
                        f"{root.describe(table)}; is this a Kaggle-layout ImageNet? {hint}")
    try:
        return root.read_text(table)
    except UnicodeDecodeError:
        raise UserError(f"{root.describe(table)}: not UTF-8 text") from None

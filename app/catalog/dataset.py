"""A catalog entry as an object for the Python API: its tables, read and checked as the driver
reads them, come back as labelled image lists (`Split`) for `app.prepare_training`:

    data = catalog.dataset("imagenet_s3")
    train = data.solutions("LOC_train_solution.csv", classes=range(100))  # boxed images only
    val = data.split("val", classes=range(100))                           # any layout
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import pandas as pd

import app.catalog.imagefolder as imagefolder
import app.catalog.shards as shards
import app.catalog.tables as tables
from app.catalog.labels import SYNSET_MAPPING, ClassIndex
from app.catalog.storage import SHARD_LAYOUTS, DatasetRoot
from app.runtime.errors import UserError

SPLITS = ("train", "val")


@dataclass(frozen=True)
class Split:
    """[path, label] images of one dataset: paths relative to `root`, labels index `classes`."""
    root: DatasetRoot
    frame: pd.DataFrame
    classes: ClassIndex
    source: str  # where the list came from, for messages and the run's config

    def __len__(self) -> int:
        return len(self.frame)

    @property
    def num_classes(self) -> int:
        return len(self.classes.wnids)

    def __repr__(self) -> str:
        return (f"Split({self.root.name}: {self.source}, {len(self)} images, "
                f"{self.num_classes} classes)")


class Dataset:
    """One opened catalog entry. `classes` everywhere takes what --classes takes (a count,
    0 = all; wnids as a list or a comma-separated string) or class indices (a range or a
    list of ints, positions in the dataset's class order)."""

    def __init__(self, root: DatasetRoot):
        self.root = root

    @property
    def name(self) -> str:
        return self.root.name

    def __repr__(self) -> str:
        return f"Dataset({self.name!r}, {self.root.url}, layout {self.root.layout})"

    def solutions(self, table: str, classes: object = 0, split: str = "") -> Split:
        """The images a Kaggle LOC solution table lists (LOC_train_solution.csv names only the
        train images with boxes, about 42% of them; LOC_val_solution.csv every val image).
        `split` says whose images the table names; by default its file name does."""
        if self.root.layout != "kaggle":
            raise UserError(f"dataset '{self.name}' has the {self.root.layout} layout, without "
                            f"LOC tables; use .split(\"train\") or .split(\"val\")")
        split = split or next((s for s in SPLITS if s in table.lower()), "")
        if split not in SPLITS:
            raise UserError(f"solutions({table!r}): say whose images it lists with "
                            "split=\"train\" or split=\"val\"")
        index = self.class_index(classes)
        read = tables.train_solutions if split == "train" else tables.val_solutions
        return Split(self.root, read(self.root, table, index), index, table)

    def split(self, name: str, classes: object = 0, train_index: str = "cls") -> Split:
        """A whole split in any layout: train (Kaggle: `train_index` as the driver's
        --train-index, train_cls.txt by default) or val."""
        if name not in SPLITS:
            raise UserError(f"split({name!r}): the splits are {', '.join(SPLITS)}")
        if train_index not in ("cls", "csv", "listing"):
            raise UserError(f"train_index={train_index!r}: must be cls, csv or listing")
        index = self.class_index(classes)
        both = tables.load_tables(self.root, index, train_index)
        source = f"{name} ({self.root.layout} layout)"
        return Split(self.root, both.train if name == "train" else both.val, index, source)

    def class_index(self, classes: object = 0) -> ClassIndex:
        """The selected classes, in the dataset's class order."""
        every = self.all_classes
        source = self.root.describe(SYNSET_MAPPING if self.root.layout == "kaggle" else
                                    imagefolder.TRAIN_FOLDER)
        return ClassIndex.select(every.wnids, every.descriptions,
                                 as_selection(classes, every.wnids, source), source, every.order)

    @functools.cached_property
    def all_classes(self) -> ClassIndex:
        """Read once per object: the synset mapping, or the class folders' listing."""
        if self.root.layout == "imagefolder":
            return imagefolder.class_index_of(self.root)
        if self.root.layout in SHARD_LAYOUTS:
            return shards.class_index(self.root)
        return tables.class_index(self.root)


def as_selection(classes: object, known: list[str], source: str) -> int | list[str]:
    """What --classes takes (a count, wnids) from what a caller may pass (indices, "a,b", ...)."""
    if isinstance(classes, str):
        return [c.strip() for c in classes.split(",") if c.strip()]
    if isinstance(classes, bool):
        raise UserError(f"classes={classes!r}: give a count, wnids or class indices")
    if isinstance(classes, int):
        return classes
    if isinstance(classes, Iterable):
        chosen = list(classes)
        if chosen and all(isinstance(c, str) for c in chosen):
            return chosen
        if chosen and all(isinstance(c, int) and not isinstance(c, bool) for c in chosen):
            outside = [c for c in chosen if not 0 <= c < len(known)]
            if outside:
                raise UserError(f"classes: index {outside[0]} is outside 0..{len(known) - 1} "
                                f"({source} lists {len(known)} classes)")
            return [known[c] for c in chosen]
    raise UserError(f"classes={classes!r}: give a count, wnids (a list or 'n01440764,...') "
                    "or class indices (range(10), [0, 5, 7])")

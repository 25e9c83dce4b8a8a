"""What every dataset layout produces and checks the same way: the labelled frames, the class
index and its selection, and the rules that keep paths inside the dataset root."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd

from app.catalog.storage import DatasetRoot
from app.runtime.errors import UserError

SYNSET_MAPPING = "LOC_synset_mapping.txt"  # "<wnid> <description>" lines, in label order
# File names in the tables: letters, digits, '_', '-', '.'; never '..', '/' or a scheme.
SAFE_NAME = r"(?!\.\.?$)[A-Za-z0-9_.\-]+"
SAFE_ID = re.compile(rf"^{SAFE_NAME}$")
# A listed path that stays inside the root: components without separators or control
# characters, never '.' or '..' (pandas' str.fullmatch takes it as it is).
_COMPONENT = r"(?!\.\.?(?:/|$))[^/\\\x00-\x1f\x7f]+"
_SAFE_PATH = rf"{_COMPONENT}(?:/{_COMPONENT})*"


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
    """All classes of the dataset and the selected ones; label = position in `wnids`."""
    known: frozenset[str]
    wnids: list[str]
    descriptions: list[str]
    order: tuple[str, ...] = ()  # every class in the order of the data's own class indices

    @classmethod
    def select(cls, known: list[str], words: list[str], classes: int | list[str], source: str,
               order: tuple[str, ...] = ()) -> "ClassIndex":
        """The classes `classes` selects (select_classes) among `known`, named by `words`."""
        wnids = select_classes(known, classes, source)
        descriptions = dict(zip(known, words))
        return cls(frozenset(known), wnids, [descriptions[w] for w in wnids], order)


Classes = int | list[str] | ClassIndex  # a count (0 = all), wnids, or an index built already


def select_classes(known: list[str], classes: int | list[str], source: str) -> list[str]:
    """The selected wnids in `known`'s order: all (0), the first N, or a named list."""
    if isinstance(classes, int):
        if classes > len(known):
            raise UserError(f"classes = {classes}, but {source} lists only {len(known)}; "
                            f"choose at most {len(known)}")
        return known[:classes] if classes else known
    if not classes:
        raise UserError("classes is an empty list: it selects no classes; give wnids or a count")
    unknown = [w for w in classes if w not in set(known)]
    if unknown:
        raise UserError(f"class {unknown[0]} is not in {source}; check the wnid")
    chosen = set(classes)
    return [w for w in known if w in chosen]


def parse_synset_mapping(text: str, where: str) -> pd.DataFrame:
    """Frame [wnid, description] in file order; `where` names the file in messages."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        wnid, _, description = line.strip().partition(" ")
        if not SAFE_ID.match(wnid):
            raise UserError(f"{where} line {number}: expected '<wnid> <description>', got "
                            f"{line[:60]!r}")
        rows.append((wnid, description.strip()))
    mapping = pd.DataFrame(rows, columns=["wnid", "description"])
    duplicated = mapping.wnid[mapping.wnid.duplicated()]
    if len(duplicated):
        raise UserError(f"{where}: wnid {duplicated.iloc[0]} is listed twice; each class must "
                        "appear once")
    if mapping.empty:
        raise UserError(f"{where}: no classes listed")
    return mapping


def read_text(root: DatasetRoot, name: str) -> str:
    try:
        return root.read_text(name)
    except UnicodeDecodeError:
        raise UserError(f"{root.describe(name)}: not UTF-8 text") from None


def read_synset_mapping(root: DatasetRoot) -> pd.DataFrame:
    return parse_synset_mapping(read_text(root, SYNSET_MAPPING), root.describe(SYNSET_MAPPING))


def check_listed(names: pd.Series, where: str) -> None:
    """Listed names (of files or folders) must stay inside the dataset root."""
    unsafe = names[~names.str.fullmatch(_SAFE_PATH)]
    if len(unsafe):
        raise UserError(f"{where}: listed name {unsafe.iloc[0][:80]!r} is not a plain path "
                        "inside the dataset root ('.', '..', empty parts or control "
                        "characters); rename or remove it")


def finish(frame: pd.DataFrame, where: str, check: str = "the table") -> pd.DataFrame:
    """The [path, label] frame; an empty selection is the user's to fix."""
    if frame.empty:
        raise UserError(f"{where}: no images for the selected classes; check `classes` and "
                        f"{check}")
    return frame[["path", "label"]].reset_index(drop=True)

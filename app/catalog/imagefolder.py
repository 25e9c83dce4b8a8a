"""The ImageFolder layout -> labelled frames: train/<wnid>/*, val/<wnid>/* and optionally
LOC_synset_mapping.txt, as torchvision's ImageFolder reads ImageNet (val re-foldered by class).
Label = position among the sorted wnids (for ImageNet the mapping's order too, as in the Kaggle
layout); the mapping, when present, names the classes and must know every folder.
"""

from __future__ import annotations

import pandas as pd

from app.catalog.labels import (SAFE_ID, SYNSET_MAPPING, Classes, ClassIndex, Tables,
                                check_listed, finish, read_synset_mapping)
from app.catalog.storage import DatasetRoot
from app.runtime.errors import UserError

TRAIN_FOLDER = "train"
VAL_FOLDER = "val"
# torchvision's IMG_EXTENSIONS: other files are not images and are left out (and counted).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def load_tables(root: DatasetRoot, classes: Classes = 0) -> Tables:
    notes: list[str] = []
    train_images, train_folders = _images(root, TRAIN_FOLDER, notes)
    index = classes if isinstance(classes, ClassIndex) else class_index(
        root, train_images, train_folders, classes)
    val_images, _ = _images(root, VAL_FOLDER, notes)
    train = _labelled(root, TRAIN_FOLDER, train_images, index)
    val = _labelled(root, VAL_FOLDER, val_images, index)
    return Tables(train, val, index.wnids, index.descriptions, tuple(notes))


def class_index_of(root: DatasetRoot, classes: int | list[str] = 0) -> ClassIndex:
    """The class index from the class folders of train/ alone."""
    images, folders = _images(root, TRAIN_FOLDER, [])
    return class_index(root, images, folders, classes)


def class_index(root: DatasetRoot, train_images: pd.DataFrame, folders: list[str],
                classes: int | list[str] = 0) -> ClassIndex:
    """Every class folder of train/ must hold images: an empty one would still take a label
    and shift every later class's (torchvision refuses them too)."""
    wnids = sorted(set(train_images.wnid) | set(folders))
    empty = sorted(set(wnids) - set(train_images.wnid))
    if empty:
        raise UserError(f"{root.describe(f'{TRAIN_FOLDER}/{empty[0]}')}: class folder without "
                        "images; remove the folder or put its images back")
    descriptions = dict.fromkeys(wnids, "")
    if root.exists(SYNSET_MAPPING):
        mapping = read_synset_mapping(root)
        unknown = sorted(set(wnids) - set(mapping.wnid))
        if unknown:
            raise UserError(f"{root.describe(f'{TRAIN_FOLDER}/{unknown[0]}')}: class folder is "
                            f"not in {SYNSET_MAPPING}; rename the folder or fix the mapping")
        descriptions.update(zip(mapping.wnid, mapping.description))
    return ClassIndex.select(wnids, [descriptions[w] for w in wnids], classes,
                             f"{root.describe(TRAIN_FOLDER)} (class folders)")


def _images(root: DatasetRoot, split: str, notes: list[str]) -> tuple[pd.DataFrame, list[str]]:
    """Frame [path, wnid] of a split's images, and its class folders; names leaving the root and
    misnamed class folders are refused, hidden, non-image and stray files counted in `notes`."""
    if not root.exists(split):
        raise UserError(f"dataset '{root.name}': folder {root.describe(split)} not found; is "
                        "this an ImageFolder-layout dataset (train/<wnid>/, val/<wnid>/)?")
    files, folders = root.find_with_folders(split)
    check_listed(pd.Series(folders + files, dtype=str), root.describe(split))
    parts = pd.Series(files, dtype=str).str.split("/")
    hidden = parts.map(lambda p: any(part.startswith(".") for part in p[1:]))
    image = (parts.str.len() >= 3) & ~hidden & parts.str[-1].str.lower().str.endswith(
        IMAGE_SUFFIXES)
    if (~image).any():
        notes.append(f"{root.describe(split)}: left out {int((~image).sum())} files that are "
                     "not images in a class folder (hidden, another suffix or outside the "
                     f"class folders; first: {files[int((~image).idxmax())][:80]})")
    frame = pd.DataFrame({"path": pd.Series(files, dtype=str)[image],
                          "wnid": parts[image].str[1]})
    class_folders = sorted({p.split("/")[1] for p in folders if "/" in p} | set(frame.wnid))
    class_folders = [f for f in class_folders if not f.startswith(".")]
    misnamed = [f for f in class_folders if not SAFE_ID.match(f)]
    if misnamed:
        raise UserError(f"{root.describe(f'{split}/{misnamed[0]}')}: class folder name is not "
                        "a wnid (letters, digits, '_', '-', '.'); rename the folder")
    return frame, class_folders


def _labelled(root: DatasetRoot, split: str, images: pd.DataFrame, index: ClassIndex
              ) -> pd.DataFrame:
    unknown = sorted(set(images.wnid) - index.known)
    if unknown:
        raise UserError(f"{root.describe(f'{split}/{unknown[0]}')}: no such class folder in "
                        f"{TRAIN_FOLDER}/; remove it or add the class's train images")
    labels = {w: i for i, w in enumerate(index.wnids)}
    frame = images[images.wnid.isin(labels)].copy()
    frame["label"] = frame.wnid.map(labels).astype("int64")
    return finish(frame, root.describe(split), "the class folders")

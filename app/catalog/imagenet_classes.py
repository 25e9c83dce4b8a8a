"""ImageNet-1k's classes in their standard order (sorted wnids) with their words, for datasets
that carry only class indices. Read from timm's files (timm/data/_info/), not by importing timm:
that would import torch, which the catalog never does.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from app.runtime.errors import UserError


@functools.cache
def wnids_and_words() -> tuple[list[str], list[str]]:
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("ImageNet-1k's class names come from timm, which is not installed; "
                        "pip install -r requirements.txt, or put LOC_synset_mapping.txt "
                        "beside the shards")
    folder = Path(spec.submodule_search_locations[0]) / "data" / "_info"
    wnids = (folder / "imagenet_synsets.txt").read_text().split()
    words = dict(line.split("\t", 1) for line in
                 (folder / "imagenet_synset_to_lemma.txt").read_text().splitlines() if "\t" in line)
    return wnids, [words.get(wnid, "") for wnid in wnids]

"""Real photos: a slice of Imagenette made at run time from a local copy (IMAGENETTE_ROOT, e.g.
thunderInfy/imagenette's train/<wnid>/*.JPEG, val/<wnid>/*.JPEG; never committed), trained
through the driver by each decoder that runs on a CPU. Skipped, with the reason, where no copy
is present (CI has none); tests/test_archive.py covers the download path with photos of its own."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import REPO, TINY_TRAIN_FLAGS, run_driver, skipped_rows, write_catalog

CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS = 3, 16, 6
COPY = Path(os.environ.get("IMAGENETTE_ROOT", REPO / "data" / "imagenette"))


@pytest.fixture(scope="module")
def imagenette_slice(tmp_path_factory) -> Path:
    if not (COPY / "train").is_dir() or not (COPY / "val").is_dir():
        pytest.skip(f"no Imagenette copy at {COPY} (set IMAGENETTE_ROOT to a folder with "
                    "train/<wnid>/ and val/<wnid>/)")
    out = tmp_path_factory.mktemp("imagenette-slice")
    for split, count in (("train", TRAIN_PER_CLASS), ("val", VAL_PER_CLASS)):
        for wnid in sorted(os.listdir(COPY / split))[:CLASSES]:
            (out / split / wnid).mkdir(parents=True)
            for name in sorted(os.listdir(COPY / split / wnid))[:count]:
                shutil.copy(COPY / split / wnid / name, out / split / wnid / name)
    return out


@pytest.mark.parametrize("decoder", ["pillow", "dali"])
def test_a_slice_of_real_photos_trains_with_every_photo_decoded(tmp_path, imagenette_slice,
                                                                  decoder):
    catalog = write_catalog(tmp_path / "datasets.toml", {"photos": {
        "url": str(imagenette_slice), "layout": "imagefolder"}})
    result = run_driver("--catalog", str(catalog), *TINY_TRAIN_FLAGS, "--epochs", "1",
                        "--decoder", decoder, "--device", "cpu", "-b", "16",
                        "--output-dir", str(tmp_path), "--run-name", "photos", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "photos" / "metrics.jsonl")
               .read_text().splitlines()]
    epoch = next(record for record in records if "val/top1" in record)
    assert epoch["train/images"] == CLASSES * TRAIN_PER_CLASS
    assert epoch["val/images"] == CLASSES * VAL_PER_CLASS
    assert epoch["train/skipped"] == epoch["val/skipped"] == 0
    assert skipped_rows(tmp_path / "photos") == []

import hashlib

import numpy as np
import pandas as pd
from PIL import Image

from app.catalog import sample, tables


def digest(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_other_bytes(tiny_sample, tmp_path):
    again = digest(sample.generate(tmp_path / "again", "tiny", 0))
    assert again == digest(tiny_sample)
    other = digest(sample.generate(tmp_path / "other", "tiny", 1))
    assert other.keys() != again.keys() or other != again
    assert sum(other.get(k) == v for k, v in again.items()) <= 1  # only the mapping may match


def test_kaggle_layout_and_table_formats(tiny_sample):
    spec = sample.PRESETS["tiny"]
    mapping = (tiny_sample / "LOC_synset_mapping.txt").read_text().splitlines()
    assert mapping[0] == "n01440764 tench, Tinca tinca" and len(mapping) == spec.classes
    listing = (tiny_sample / tables.TRAIN_CLS).read_text().splitlines()
    assert len(listing) == spec.classes * spec.train_per_class
    assert listing[0].split(" ")[1] == "1" and listing[-1].split(" ")[1] == str(len(listing))
    for line in listing:
        entry = line.split(" ")[0]
        wnid, image_id = entry.split("/")
        assert image_id.startswith(wnid + "_")
        assert (tiny_sample / tables.TRAIN_DIR / f"{entry}.JPEG").is_file()
    val_files = sorted((tiny_sample / tables.VAL_DIR).iterdir())
    assert val_files[0].name == "ILSVRC2012_val_00000001.JPEG"
    assert len(val_files) == spec.classes * spec.val_per_class


def test_solution_csvs_look_like_the_real_ones(tiny_sample):
    train = pd.read_csv(tiny_sample / "LOC_train_solution.csv", dtype=str)
    val = pd.read_csv(tiny_sample / "LOC_val_solution.csv", dtype=str)
    assert list(train.columns) == ["ImageId", "PredictionString"]
    listed = len((tiny_sample / tables.TRAIN_CLS).read_text().splitlines())
    assert 0.3 * listed < len(train) < 0.7 * listed  # only the "boxed" part of train
    for frame in (train, val):
        assert frame.PredictionString.str.endswith(" ").all()  # the real files' trailing space
        groups = frame.PredictionString.str.split().str.len()
        assert (groups % 5 == 0).all() and (groups > 5).any()  # several boxes sometimes
    assert (train.PredictionString.str.split().str[0] == train.ImageId.str.split("_").str[0]).all()


def test_boxes_lie_inside_their_images(tiny_sample):
    val = pd.read_csv(tiny_sample / "LOC_val_solution.csv", dtype=str)
    for image_id, boxes in zip(val.ImageId[:30], val.PredictionString[:30]):
        width, height = Image.open(tiny_sample / tables.VAL_DIR / f"{image_id}.JPEG").size
        numbers = boxes.split()
        for i in range(0, len(numbers), 5):
            x0, y0, x1, y1 = map(int, numbers[i + 1:i + 5])
            assert 0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height


def test_the_real_datas_quirks_are_there(tiny_sample):
    kinds = {"cmyk": [], "png": [], "gray": []}
    for path in (tiny_sample / tables.TRAIN_DIR).rglob("*.JPEG"):
        image = Image.open(path)
        if image.format == "PNG":
            kinds["png"].append(path)
        elif image.mode == "CMYK":
            kinds["cmyk"].append(path)
        elif image.mode == "L":
            kinds["gray"].append(path)
        else:
            assert image.format == "JPEG" and image.mode == "RGB"
    assert {k: len(v) for k, v in kinds.items()} == {"cmyk": 1, "png": 1, "gray": 1}


def test_bench_preset_makes_imagenet_sized_jpegs(tmp_path):
    spec = sample.PRESETS["bench"]
    sizes, dims = [], []
    for i in range(12):
        job = sample.ImageJob(str(tmp_path / f"{i}.JPEG"), i * 8, (0, 1, i), spec.classes, spec)
        sample.write_image(job)
        sizes.append((tmp_path / f"{i}.JPEG").stat().st_size)
        dims.append(Image.open(job.path).size)
    assert 60_000 < np.mean(sizes) < 120_000
    assert all(330 <= w <= 500 and 330 <= h <= 500 for w, h in dims)
    assert spec.classes * spec.train_per_class >= 10_000


def test_imagefolder_layout_holds_the_same_images(tiny_sample, tiny_imagefolder):
    """Same bytes under each file name; val re-foldered by class; only the mapping as table."""
    def images(digests):
        return {name.rsplit("/", 1)[-1]: h for name, h in digests.items() if name.endswith(".JPEG")}
    kaggle, folders = digest(tiny_sample), digest(tiny_imagefolder)
    assert images(folders) == images(kaggle) and len(images(folders)) == 420
    assert {n for n in folders if not n.endswith(".JPEG")} == {"LOC_synset_mapping.txt"}
    val = pd.read_csv(tiny_sample / "LOC_val_solution.csv", dtype=str)
    for image_id, boxes in zip(val.ImageId, val.PredictionString):
        assert (tiny_imagefolder / "val" / boxes.split()[0] / f"{image_id}.JPEG").is_file()
    assert all(n.split("/")[0] in ("train", "val") and n.count("/") == 2
               for n in folders if n.endswith(".JPEG"))

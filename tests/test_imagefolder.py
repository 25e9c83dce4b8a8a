"""The ImageFolder layout: one folder per class under train/ and val/."""

import shutil

import pytest

from app.catalog import Catalog
from app.catalog.storage import DatasetRoot
from app.catalog.tables import load_tables
from app.runtime.errors import UserError
from conftest import write_catalog


def folders_root(folder) -> DatasetRoot:
    return DatasetRoot("folders", str(folder), layout="imagefolder")


def by_file_name(frame):
    return dict(zip(frame.path.str.rsplit("/", n=1).str[-1], frame.label))


def test_same_images_same_labels_as_the_kaggle_layout(tiny_sample, tiny_imagefolder):
    """The sample in both layouts: every image has the same label, and the class order (sorted
    wnids) is the synset mapping's, whose descriptions name the classes."""
    kaggle = load_tables(DatasetRoot("kaggle", str(tiny_sample)))
    folders = load_tables(folders_root(tiny_imagefolder))
    assert folders.wnids == kaggle.wnids == sorted(kaggle.wnids)
    assert folders.descriptions == kaggle.descriptions and folders.notes == ()
    for split in ("train", "val"):
        mine, theirs = getattr(folders, split), getattr(kaggle, split)
        assert by_file_name(mine) == by_file_name(theirs) and len(mine) == len(theirs)
        assert mine.path.str.startswith(f"{split}/").all()
        assert all((tiny_imagefolder / p).is_file() for p in mine.path)
    assert (folders.val.path.str.split("/").str[1].map(folders.wnids.index)
            == folders.val.label).all()


@pytest.fixture
def folders_copy(tiny_imagefolder, tmp_path):
    return shutil.copytree(tiny_imagefolder, tmp_path / "folders")


def test_class_subsets_and_no_mapping(folders_copy):
    (folders_copy / "LOC_synset_mapping.txt").unlink()
    wnids = sorted(p.name for p in (folders_copy / "train").iterdir())
    named = load_tables(folders_root(folders_copy), [wnids[6], wnids[1]])
    assert named.wnids == [wnids[1], wnids[6]] and named.descriptions == ["", ""]
    assert set(named.train.label) == set(named.val.label) == {0, 1}
    assert (named.train.path.str.split("/").str[1] == wnids[6]).eq(named.train.label == 1).all()
    assert load_tables(folders_root(folders_copy), 3).wnids == wnids[:3]
    with pytest.raises(UserError, match=r"classes = 11, but .*/train \(class folders\) lists "
                                        "only 10"):
        load_tables(folders_root(folders_copy), 11)
    with pytest.raises(UserError, match="class n00000000 is not in .*train"):
        load_tables(folders_root(folders_copy), ["n00000000"])


def test_files_that_are_not_images_are_left_out_and_counted(folders_copy):
    (folders_copy / "train" / "n01440764" / "notes.txt").write_text("not an image")
    (folders_copy / "train" / "n01440764" / "._n01440764_1.JPEG").write_bytes(b"\x00")
    (folders_copy / "train" / "README").write_text("outside any class folder")
    (folders_copy / "val" / ".DS_Store").write_bytes(b"\x00")
    tables = load_tables(folders_root(folders_copy))
    assert len(tables.train) == 320 and len(tables.val) == 100
    train_note, val_note = tables.notes
    assert "/train: left out 3 files that are not images" in train_note
    assert "/val: left out 1 files" in val_note and ".DS_Store" in val_note


@pytest.mark.parametrize("damage, message", [
    (lambda f: [p.unlink() for p in (f / "train" / "n01443537").iterdir()],
     r"train/n01443537: class folder without images"),
    (lambda f: (f / "val" / "n09999999").mkdir() or
     (f / "val" / "n09999999" / "x.JPEG").write_bytes(b"x"),
     r"val/n09999999: no such class folder in train/"),
    (lambda f: (f / "train" / "golden retriever").mkdir() or
     (f / "train" / "golden retriever" / "x.JPEG").write_bytes(b"x"),
     r"train/golden retriever: class folder name is not a wnid"),
    (lambda f: (f / "train" / "n09999999").mkdir() or
     (f / "train" / "n09999999" / "x.JPEG").write_bytes(b"x"),
     r"train/n09999999: class folder is not in LOC_synset_mapping.txt"),
    (lambda f: shutil.rmtree(f / "val"), r"folder .*/val not found"),
])
def test_damaged_folders_are_named(folders_copy, damage, message):
    damage(folders_copy)
    with pytest.raises(UserError, match=message) as error:
        load_tables(folders_root(folders_copy))
    assert "\n" not in str(error.value)


def test_catalog_entries_take_the_layout(tiny_imagefolder, tmp_path):
    catalog = Catalog.load(write_catalog(tmp_path / "c.toml", {
        "copy": {"url": str(tiny_imagefolder), "layout": "imagefolder"},
        "generated": {"sample": "tiny", "layout": "imagefolder"}}))
    copy, generated = catalog.open("copy"), catalog.open("generated")
    assert copy.layout == generated.layout == "imagefolder"
    assert generated.url == str(tiny_imagefolder)  # the sample cache's folder for this layout
    assert load_tables(copy).train.equals(load_tables(generated).train)
    with pytest.raises(UserError, match="unknown layout 'pytorch'; known: kaggle, imagefolder"):
        Catalog.load(write_catalog(tmp_path / "bad.toml", {"x": {"sample": "tiny",
                                                                  "layout": "pytorch"}}))

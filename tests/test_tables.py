import pandas as pd
import pytest

from app.catalog.storage import DatasetRoot
from app.catalog.tables import (load_tables, synset_mapping, train_cls_list, train_listing,
                                train_solutions, val_solutions)
from app.runtime.errors import UserError


def root_of(folder) -> DatasetRoot:
    return DatasetRoot("test", str(folder))


def csv_rows(path) -> pd.DataFrame:
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def test_labels_follow_the_synset_mapping_order(tiny_sample):
    root = root_of(tiny_sample)
    wnids = list(synset_mapping(root).wnid)
    train = train_cls_list(root)
    folder_wnid = train.path.str.split("/").str[-2]
    assert (folder_wnid.map(wnids.index) == train.label).all()
    val = val_solutions(root)
    truth = csv_rows(tiny_sample / "LOC_val_solution.csv")
    truth_label = dict(zip(truth.ImageId, truth.PredictionString.str.split().str[0].map(wnids.index)))
    image_ids = val.path.str.rsplit("/", n=1).str[-1].str.removesuffix(".JPEG")
    assert (image_ids.map(truth_label) == val.label).all()
    assert len(val) == len(truth)


def test_full_list_and_directory_listing_agree(tiny_sample):
    root = root_of(tiny_sample)
    by_list = train_cls_list(root).sort_values("path").reset_index(drop=True)
    by_listing = train_listing(root).sort_values("path").reset_index(drop=True)
    assert by_list.equals(by_listing)
    assert all((tiny_sample / p).is_file() for p in by_list.path)


def test_csv_index_covers_only_boxed_images_and_warns(tiny_sample):
    root = root_of(tiny_sample)
    boxed = train_solutions(root, "LOC_train_solution.csv")
    (note,) = load_tables(root, train_index="csv").notes
    assert "only the images with boxes" in note and "42%" in note
    assert f"({len(boxed)} here" in note
    assert load_tables(root).notes == ()  # the full list needs no warning
    full = train_cls_list(root)
    assert 0 < len(boxed) < len(full)
    assert set(boxed.path) <= set(full.path)
    merged = boxed.merge(full, on="path", suffixes=("_csv", "_cls"))
    assert (merged.label_csv == merged.label_cls).all()


def test_class_subsets_by_count_and_by_name(tiny_sample):
    root = root_of(tiny_sample)
    wnids = list(synset_mapping(root).wnid)
    first3 = load_tables(root, 3)
    assert first3.wnids == wnids[:3]
    assert sorted(first3.train.label.unique()) == [0, 1, 2]
    named = load_tables(root, [wnids[7], wnids[2]])  # label order = mapping order, not list order
    assert named.wnids == [wnids[2], wnids[7]]
    folders = named.train.path.str.split("/").str[-2]
    assert ((folders == wnids[2]) == (named.train.label == 0)).all()
    assert set(named.val.label) == {0, 1}
    assert named.num_classes == 2 and "," in load_tables(root, 3).descriptions[2]


def edit_csv(folder, name, fn):
    path = folder / name
    lines = path.read_text().splitlines()
    path.write_text("\n".join(fn(lines)) + "\n")


@pytest.mark.parametrize("bad_id", ["../../../etc/passwd", "/etc/passwd", "s3://other/x",
                                    "..", "a/../../b", "C:\\x"])
def test_image_ids_that_escape_the_root_are_rejected(tiny_copy, bad_id):
    edit_csv(tiny_copy, "LOC_val_solution.csv",
             lambda lines: lines[:3] + [f"{bad_id},n01440764 1 2 3 4 "] + lines[3:])
    with pytest.raises(UserError) as error:
        val_solutions(root_of(tiny_copy))
    message = str(error.value)
    assert "LOC_val_solution.csv line 4" in message and "escape the dataset root" in message


def test_train_cls_entries_that_escape_the_root_are_rejected(tiny_copy):
    path = tiny_copy / "ILSVRC/ImageSets/CLS-LOC/train_cls.txt"
    path.write_text(path.read_text() + "../../secret 99\n")
    with pytest.raises(UserError, match=r"train_cls.txt line \d+: entry '../../secret'"):
        train_cls_list(root_of(tiny_copy))


def test_unknown_wnid_names_file_and_line(tiny_copy):
    edit_csv(tiny_copy, "LOC_train_solution.csv",
             lambda lines: lines[:5] + ["n01440764_99999,n99999999 1 2 3 4 "] + lines[5:])
    with pytest.raises(UserError, match=r"LOC_train_solution.csv line 6: wnid 'n99999999' is "
                                        r"not in LOC_synset_mapping.txt"):
        train_solutions(root_of(tiny_copy))


def test_csv_without_expected_columns(tiny_copy):
    edit_csv(tiny_copy, "LOC_val_solution.csv", lambda lines: ["image,label"] + lines[1:])
    with pytest.raises(UserError, match="expected columns ImageId,PredictionString, found "
                                        "image,label"):
        val_solutions(root_of(tiny_copy))


def test_missing_table(tiny_copy):
    (tiny_copy / "LOC_val_solution.csv").unlink()
    with pytest.raises(UserError, match="table LOC_val_solution.csv not found"):
        load_tables(root_of(tiny_copy))


def test_empty_selection(tiny_copy):
    wnid = synset_mapping(root_of(tiny_copy)).wnid[1]
    edit_csv(tiny_copy, "LOC_val_solution.csv",
             lambda lines: [line for line in lines if f",{wnid} " not in line])
    with pytest.raises(UserError, match="LOC_val_solution.csv: no images for the selected"):
        load_tables(root_of(tiny_copy), [wnid])
    with pytest.raises(UserError, match="selects no classes"):
        load_tables(root_of(tiny_copy), [])
    with pytest.raises(UserError, match="classes = 11, but .* lists only 10"):
        load_tables(root_of(tiny_copy), 11)
    with pytest.raises(UserError, match="class n00000000 is not in"):
        load_tables(root_of(tiny_copy), ["n00000000"])


def test_duplicate_wnid_in_mapping(tiny_copy):
    path = tiny_copy / "LOC_synset_mapping.txt"
    first = path.read_text().splitlines()[0]
    path.write_text(path.read_text() + first + "\n")
    with pytest.raises(UserError, match="n01440764 is listed twice"):
        synset_mapping(root_of(tiny_copy))

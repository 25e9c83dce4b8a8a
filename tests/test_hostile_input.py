"""Property-based tests: whatever a user (or a damaged download) puts in datasets.toml, a run
config or the LOC tables, the result is a valid catalog/config/table or one UserError line,
never a traceback; and no accepted table row points outside the dataset root."""

import re
import uuid
from pathlib import Path

import fsspec
import pandas as pd
import pytest
import tomli_w
from hypothesis import HealthCheck, event, given, settings, strategies as st

from app.catalog.catalog import ENTRY_KEYS, Catalog
from app.catalog.imagefolder import IMAGE_SUFFIXES
from app.catalog.storage import DatasetRoot
from app.catalog.tables import SYNSET_MAPPING, TRAIN_CLS, TRAIN_SOLUTION, VAL_SOLUTION
from app.catalog.tables import (load_tables, synset_mapping, train_cls_list, train_solutions,
                                val_solutions)
from app.config.sources import parse_config
from app.runtime.errors import UserError

EXAMPLES = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
WNIDS = ["n01440764", "n01443537", "n01484850"]
MAPPING = "".join(f"{w} class {i}, a description\n" for i, w in enumerate(WNIDS))
# Pieces real and broken tables are made of: ids, escapes, schemes, quotes, separators.
PIECES = st.one_of(
    st.sampled_from([*WNIDS, "n99999999", "ILSVRC2012_val_00000001", "n01440764_10026", "..",
                     ".", "../..", "/etc/passwd", "s3://bucket/key", "http://host/x",
                     "file:///etc", "C:\\x", "~", '"', "'", "", " ", "1", "-7", "nan", "NA",
                     "ImageId", "PredictionString", "\x00", "\ufeff", "é"]),
    st.text(max_size=12))
LINES = st.lists(st.lists(PIECES, max_size=6).flatmap(
    lambda pieces: st.sampled_from([" ", ",", "/", "\t", ", "]).map(lambda sep: sep.join(pieces))),
    max_size=8)
TABLE_TEXT = st.one_of(st.text(max_size=300), LINES.map("\n".join))
# Well-formed rows, then rows with any id or wnid: accepted tables must be safe ones.
GOOD_ID = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,15}", fullmatch=True)
ANY_ID = st.one_of(GOOD_ID, PIECES)
ANY_WNID = st.one_of(st.sampled_from(WNIDS), PIECES)


def solution_rows(ids, wnids):
    box = st.lists(st.integers(-5, 500), min_size=4, max_size=4).map(lambda box: " ".join(map(str, box)))
    row = st.tuples(ids, wnids, box).map(lambda r: f"{r[0]},{r[1]} {r[2]} ")
    return st.lists(row, max_size=8).map(lambda rows: "\n".join(rows) + "\n")


def cls_rows(wnids, ids):
    row = st.tuples(wnids, ids, st.integers(1, 10**6)).map(lambda r: f"{r[0]}/{r[1]} {r[2]}")
    return st.lists(row, max_size=8).map("\n".join)


SOLUTION_TEXT = st.one_of(TABLE_TEXT, solution_rows(GOOD_ID, st.sampled_from(WNIDS)),
                          solution_rows(ANY_ID, ANY_WNID))
CLS_TEXT = st.one_of(TABLE_TEXT, cls_rows(st.sampled_from(WNIDS), GOOD_ID),
                     cls_rows(ANY_WNID, ANY_ID))
SAFE_PATH = re.compile(r"^ILSVRC/Data/CLS-LOC/(train/[A-Za-z0-9_.\-]+/|val/)[A-Za-z0-9_.\-]+$")


def one_line_error(error: UserError, names: str) -> None:
    message = str(error)
    assert "\n" not in message and names in message, message


def memory_root(files: dict[str, str], layout: str = "kaggle", folders: tuple[str, ...] = ()
                ) -> DatasetRoot:
    """A dataset root on fsspec's in-memory filesystem holding `files` (and empty `folders`)."""
    url = f"memory://hostile-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for name, text in files.items():
        try:
            fs.pipe_file(f"{url}/{name}", text.encode("utf-8", "surrogatepass"))
        except (FileExistsError, NotADirectoryError):
            continue  # a file where a folder is (or the reverse): this filesystem cannot hold it
    for folder in folders:
        try:
            fs.makedirs(f"{url}/{folder}", exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            continue
    return DatasetRoot("hostile", url, layout=layout)


def assert_safe_table(frame: pd.DataFrame, classes: int) -> None:
    assert list(frame.columns) == ["path", "label"] and len(frame) > 0
    assert frame.path.map(lambda p: bool(SAFE_PATH.match(p)) and "/../" not in f"/{p}/").all()
    assert frame.label.between(0, classes - 1).all()


@EXAMPLES
@given(TABLE_TEXT)
def test_synset_mapping_is_parsed_or_refused(text):
    try:
        mapping = synset_mapping(memory_root({SYNSET_MAPPING: text}))
    except UserError as error:
        one_line_error(error, SYNSET_MAPPING)
        return
    assert len(mapping) > 0 and mapping.wnid.is_unique
    assert mapping.wnid.str.fullmatch(r"[A-Za-z0-9_.\-]+").all()


@EXAMPLES
@given(SOLUTION_TEXT, st.sampled_from([TRAIN_SOLUTION, VAL_SOLUTION]), st.booleans())
def test_solution_csvs_are_parsed_or_refused(text, table, with_header):
    if with_header:
        text = "ImageId,PredictionString\n" + text
    read = train_solutions if table == TRAIN_SOLUTION else val_solutions
    try:
        frame = read(memory_root({SYNSET_MAPPING: MAPPING, table: text}), table)
    except UserError as error:
        one_line_error(error, table)
        return
    assert_safe_table(frame, len(WNIDS))


@EXAMPLES
@given(CLS_TEXT)
def test_train_cls_list_is_parsed_or_refused(text):
    try:
        frame = train_cls_list(memory_root({SYNSET_MAPPING: MAPPING, TRAIN_CLS: text}))
    except UserError as error:
        one_line_error(error, "train_cls.txt")
        return
    assert_safe_table(frame, len(WNIDS))


@EXAMPLES
@given(st.sampled_from(["..", "../x", "a/../../b", "/etc/passwd", "s3://b/k", "http://h/x",
                        "file:///etc/passwd", "file:x", "~/x", ".", ""]),
       st.sampled_from(WNIDS), st.sampled_from([TRAIN_SOLUTION, VAL_SOLUTION]))
def test_image_ids_that_leave_the_root_are_refused(image_id, wnid, table):
    text = f"ImageId,PredictionString\n{wnid}_1,{wnid} 1 2 3 4 \n{image_id},{wnid} 1 2 3 4 \n"
    read = train_solutions if table == TRAIN_SOLUTION else val_solutions
    try:
        frame = read(memory_root({SYNSET_MAPPING: MAPPING, table: text}), table)
    except UserError as error:
        one_line_error(error, f"{table} line 3")
        return
    raise AssertionError(f"{image_id!r} accepted: {list(frame.path)}")


@pytest.mark.parametrize("image_id", ["..__1", "_1", "n01440764"])
def test_train_image_ids_must_name_their_folder(image_id):
    """Train images live in train/<wnid>/<wnid>_<n>.JPEG: the folder comes from the id."""
    text = f"ImageId,PredictionString\n{image_id},{WNIDS[0]} 1 2 3 4 \n"
    with pytest.raises(UserError) as error:
        train_solutions(memory_root({SYNSET_MAPPING: MAPPING, TRAIN_SOLUTION: text}))
    one_line_error(error.value, f"{TRAIN_SOLUTION} line 2: ImageId {image_id!r} is not "
                                "'<wnid>_<number>'")


# ImageFolder trees: class folders and file names real and hostile (escapes, separators, hidden
# files, files that are not images), and empty class folders.
FOLDER_NAMES = st.one_of(st.sampled_from([*WNIDS, "..", ".", "", "../..", "n01440764/..",
                                          "golden retriever", "é", ".hidden", "a\\b", "\x00",
                                          "~", "s3:"]), st.text(max_size=8))
GOOD_FILES = st.one_of(st.sampled_from(["x.JPEG", "y.jpg", "z.PNG", "e f.JPEG", "sub/d.JPEG",
                                        "readme.txt", ".DS_Store", "._x.JPEG"]),
                       GOOD_ID.map(lambda name: name + ".JPEG"))
FILE_NAMES = st.one_of(GOOD_FILES, st.sampled_from(["..", ".", "", "../c.JPEG", "a/../../b.JPEG",
                                                    "/abs.JPEG"]),
                       st.text(max_size=8).map(lambda name: name + ".JPEG"))
SPLITS = st.sampled_from(["train", "val"])
# Mostly well-formed trees (whose left-out files must be counted), some with a hostile entry.
GOOD_TREES = st.lists(st.tuples(SPLITS, st.sampled_from(WNIDS), GOOD_FILES), min_size=2,
                      max_size=10)
HOSTILE = st.lists(st.tuples(st.sampled_from(["train", "val", ""]), FOLDER_NAMES, FILE_NAMES),
                   max_size=3)
TREES = st.one_of(GOOD_TREES, st.tuples(GOOD_TREES, HOSTILE).map(lambda t: t[0] + t[1]))
EMPTY_FOLDERS = st.one_of(st.just([]), st.lists(st.tuples(SPLITS, FOLDER_NAMES), max_size=2))
SAFE_LISTED = re.compile(r"^(train|val)/[A-Za-z0-9_.\-]+(/(?!\.\.?/)[^/\\\x00-\x1f]+)+$")


@EXAMPLES
@given(TREES, EMPTY_FOLDERS, st.booleans())
def test_imagefolder_trees_are_labelled_or_refused(tree, empty, with_mapping):
    """Whatever the folders hold, the tables are safe or the error is one line naming the
    dataset's folder; files that are not images never become rows, and every one left out is
    counted."""
    files = {f"{split}/{folder}/{name}".lstrip("/"): "bytes" for split, folder, name in tree}
    if with_mapping:
        files[SYNSET_MAPPING] = MAPPING
    root = memory_root(files, "imagefolder", tuple(f"{s}/{f}" for s, f in empty))
    try:
        tables = load_tables(root)
    except UserError as error:
        one_line_error(error, root.url)
        event(f"refused: {str(error).split(': ', 1)[-1][:30]}")
        return
    event("accepted")
    listed = [p for p in root.find("train") + root.find("val")]
    for frame in (tables.train, tables.val):
        assert len(frame) > 0 and frame.label.between(0, tables.num_classes - 1).all()
        assert frame.path.map(lambda p: bool(SAFE_LISTED.match(p))).all(), list(frame.path)
        assert frame.path.str.lower().str.endswith(IMAGE_SUFFIXES).all()
        assert not frame.path.str.contains("/.", regex=False).any()  # no hidden files
        wnids = frame.path.str.split("/").str[1]
        assert (wnids.map(tables.wnids.index) == frame.label).all()
    left_out = sum(int(re.search(r"left out (\d+) files", note)[1]) for note in tables.notes)
    assert len(tables.train) + len(tables.val) + left_out == len(listed)
    assert tables.wnids == sorted(tables.wnids)


# TOML values of every kind, nested: what a catalog or config file may contain.
TOML_SCALARS = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1),
                         st.floats(allow_nan=False), st.text(max_size=20),
                         st.sampled_from(["tiny", "default", "s3://b/p", "memory://x"]))
TOML_VALUES = st.recursive(TOML_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)
# Mostly-right catalog entries: the real keys with values of any type, or unknown keys.
ENTRY = st.dictionaries(st.one_of(st.sampled_from(sorted(ENTRY_KEYS)), st.text(max_size=8)),
                        TOML_VALUES, max_size=4)
CATALOG = st.fixed_dictionaries(
    {"datasets": st.dictionaries(st.text(max_size=8), st.one_of(ENTRY, TOML_VALUES),
                                 max_size=3)},
    optional={"default": TOML_VALUES, "extra": TOML_VALUES})


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile")


def write(folder: Path, text: str | bytes) -> Path:
    path = folder / "file.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return path


def load_catalog(path: Path) -> None:
    try:
        catalog = Catalog.load(path)
    except UserError as error:
        one_line_error(error, str(path))
        return
    assert catalog.default in catalog.names
    for name, entry in catalog.entries.items():
        assert set(entry) <= set(ENTRY_KEYS)
        if "url" in entry and ":" not in entry["url"]:  # local paths only: no network here
            try:
                catalog.open(name)
            except UserError as error:
                one_line_error(error, name)


@EXAMPLES
@given(st.one_of(st.text(max_size=400), st.binary(max_size=200)))
def test_catalog_text_is_parsed_or_refused(scratch, text):
    load_catalog(write(scratch, text))


@EXAMPLES
@given(CATALOG)
def test_catalog_structure_is_checked(scratch, data):
    load_catalog(write(scratch, tomli_w.dumps(data)))


@EXAMPLES
@given(st.one_of(st.text(max_size=300),
                 st.dictionaries(st.sampled_from(["data", "model", "optim", "train", "parallel",
                                                  "run", "logging", "nonsense"]),
                                 st.dictionaries(st.text(max_size=12), TOML_VALUES, max_size=3),
                                 max_size=3).map(tomli_w.dumps)))
def test_run_config_is_parsed_or_refused(scratch, text):
    path = write(scratch, text)
    try:
        config, _ = parse_config(["--config", str(path)])
    except UserError as error:
        one_line_error(error, str(path))
        return
    assert config.data.max_bad_fraction >= 0 and config.run.keep_checkpoints >= 1

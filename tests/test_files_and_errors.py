"""The two small helpers every module shares: atomic file writes and quoting an exception."""

import os

import pytest

from app.runtime.errors import first_line
from app.runtime.files import atomic_path, create_if_absent, write_atomically


def test_an_atomic_write_replaces_the_file_whole_or_not_at_all(tmp_path):
    path = tmp_path / "config.toml"
    write_atomically(path, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as temporary:
            temporary.write_text("half of the new")
            raise RuntimeError("killed while writing")
    assert path.read_text() == "old\n"
    write_atomically(path, b"new\n", durable=True)
    assert path.read_bytes() == b"new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]  # no temporaries


def test_create_if_absent_creates_once(tmp_path):
    path = tmp_path / "skipped.tsv"
    assert create_if_absent(path, "header\n")
    with open(path, "a") as handle:
        handle.write("row\n")
    assert not create_if_absent(path, "header\n")  # a later session keeps the rows
    assert path.read_text() == "header\nrow\n"
    assert os.listdir(tmp_path) == ["skipped.tsv"]


@pytest.mark.parametrize("error, expected", [
    (OSError(), "OSError"),  # str() is "": the type name stands in
    (ValueError("\n\n  second line first\nthird"), "second line first"),
    (RuntimeError("x" * 500), "x" * 160),
])
def test_first_line_never_fails_on_odd_messages(error, expected):
    assert first_line(error) == expected
    assert first_line(error, with_type=True).startswith(type(error).__name__)

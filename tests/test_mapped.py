"""A table's columns travel to spawned reader processes (DALI's, the loaders' spawn fallback) as
a file each reader maps, not through the pipe that starts the process (app/data/mapped.py)."""

from __future__ import annotations

import multiprocessing
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from app.catalog.storage import DatasetRoot
from app.data import mapped
from app.data.samples import FileSamples

ROWS = 20_000  # ~1 MB of paths: well above what travels as it is


def table(rows: int = ROWS) -> pd.DataFrame:
    return pd.DataFrame({"path": [f"train/n{i % 10:08d}/n{i % 10:08d}_{i}.JPEG"
                                  for i in range(rows)],
                         "label": np.arange(rows) % 10})


def name_and_label(samples: FileSamples, row: int, out) -> None:
    out.send((samples.name(row), int(samples.labels[row]), type(samples.paths).__name__))


def test_a_spawned_reader_maps_the_columns_and_reads_the_same_rows(tmp_path):
    samples = FileSamples(DatasetRoot("x", str(tmp_path)), table())
    columns = samples.paths.nbytes + samples.labels.nbytes
    payload = pickle.dumps(samples)
    assert columns > 500_000 and len(payload) < 2_000
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=name_and_label, args=(samples, 12_345, writer))
    child.start()
    assert reader.recv() == ("train/n00000005/n00000005_12345.JPEG", 5, "memmap")
    child.join(timeout=60)
    assert child.exitcode == 0


def test_a_small_table_travels_as_it_is(tmp_path):
    samples = FileSamples(DatasetRoot("x", str(tmp_path)), table(100))
    copy = pickle.loads(pickle.dumps(samples))
    assert not isinstance(copy.paths, np.memmap)
    assert [copy.name(row) for row in range(100)] == list(table(100).path)


def test_the_files_go_with_their_process_and_those_of_dead_processes_with_the_next(tmp_path):
    orphan = mapped.folder() / "999999999-left-by-a-killed-worker.npy"
    orphan.write_bytes(b"")
    script = ("import pickle, sys; from app.data import mapped; import numpy as np; "
              "column = np.arange(100_000); pickle.dumps(mapped.mapped(column)); "
              "print(mapped._written[id(column)][1])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=60)
    assert done.returncode == 0, done.stderr
    assert not orphan.exists()
    written = Path(done.stdout.strip())
    assert written.parent == mapped.folder() and not written.exists()

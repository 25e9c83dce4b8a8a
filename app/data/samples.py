"""A split's samples by row: bytes and label, whatever the layout. Both decoders read through
this: per-image layouts through BlobReader (one GET or file read per image), the shard layouts
through ShardSamples (whole shards on local disk, samples by offset)."""

from __future__ import annotations

from typing import Protocol

import pandas as pd

from app.catalog.storage import SHARD_LAYOUTS, DatasetRoot
from app.data.mapped import mapped
from app.data.reader import BlobReader
from app.data.sampler import ShardedBatches
from app.data.shard_reader import Sample, ShardSamples


class Samples(Protocol):
    def __len__(self) -> int: ...

    def name(self, row: int) -> str:
        """How skipped.tsv names the row's image."""

    def read(self, rows: list[int], upcoming: list[int] = (), epoch: int = 0) -> list[Sample]:
        """(bytes, "", label) or (None, why not, label) per row; `upcoming`: rows likely asked
        for next; `epoch`: the epoch being read."""


class FileSamples:
    """One blob per image: the frame's paths, read by BlobReader."""

    def __init__(self, root: DatasetRoot, frame: pd.DataFrame):
        self.reader = BlobReader(root)
        # Fixed-width bytes, not Python strings: forked workers then share these pages
        # instead of copying them as reference counts change.
        self.paths = frame.path.str.encode("utf-8").to_numpy().astype("S")
        self.labels = frame.label.to_numpy()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "paths": mapped(self.paths), "labels": mapped(self.labels)}

    def __len__(self) -> int:
        return len(self.paths)

    def name(self, row: int) -> str:
        return self.paths[row].decode("utf-8")

    def read(self, rows: list[int], upcoming: list[int] = (), epoch: int = 0) -> list[Sample]:
        blobs = self.reader.read_many([self.name(row) for row in rows],
                                      [self.name(row) for row in upcoming])
        return [(data, reason, int(self.labels[row]))
                for row, (data, reason) in zip(rows, blobs)]


def open_samples(root: DatasetRoot, frame: pd.DataFrame, batches: ShardedBatches) -> Samples:
    if root.layout in SHARD_LAYOUTS:
        return ShardSamples(root, frame, batches)
    return FileSamples(root, frame)

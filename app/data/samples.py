"""A split's samples by row: bytes and label, whatever the layout. Every decoder reads through
this: per-image layouts through BlobReader, the shard layouts through ShardSamples."""

from __future__ import annotations

from typing import Protocol

import pandas as pd

from app.catalog.storage import SHARD_LAYOUTS, DatasetRoot
from app.data.mapped import Rows
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


class FileSamples(Rows):
    """One blob per image: the frame's paths, read by BlobReader."""

    def __init__(self, root: DatasetRoot, frame: pd.DataFrame):
        super().__init__(frame)
        self.reader = BlobReader(root)

    def read(self, rows: list[int], upcoming: list[int] = (), epoch: int = 0) -> list[Sample]:
        blobs = self.reader.read_many([self.name(row) for row in rows],
                                      [self.name(row) for row in upcoming])
        return [(data, reason, int(self.labels[row]))
                for row, (data, reason) in zip(rows, blobs)]


def open_samples(root: DatasetRoot, frame: pd.DataFrame, batches: ShardedBatches) -> Samples:
    if root.layout in SHARD_LAYOUTS:
        return ShardSamples(root, frame, batches)
    return FileSamples(root, frame)

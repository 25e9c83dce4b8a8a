"""The order of a sharded dataset's samples (the wds and parquet layouts): a function of
(seed, epoch) only, so everything ShardedBatches guarantees still holds.

Per epoch a seeded permutation of the shards, cut into windows of W consecutive shards, each
window's samples permuted, the windows one after another. So every rank of a machine reads the
same window's shards: the machine's cache fetches them once (app/catalog/shard_store.py) and a
window ahead (app/data/shard_reader.py). W trades shuffle quality for disk: samples mix only
within a window, and the cache holds three windows (the previous, the current and the next).
"""

from __future__ import annotations

import numpy as np

from app.data.sampler import ShardedBatches

DEFAULT_WINDOW = 16  # shards: 3 windows of timm's ImageNet tars are a few GB
SHARD_ORDER = 0x5A4D  # tells the shard permutation's stream apart from the windows'


class WindowedBatches(ShardedBatches):
    def __init__(self, shards: np.ndarray, batch_size: int, *, window: int = DEFAULT_WINDOW,
                 **options):
        """`shards`: each row's shard position, rows grouped by shard in ascending order."""
        super().__init__(len(shards), batch_size, **options)
        counts = np.bincount(shards) if len(shards) else np.zeros(0, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.shard_count = len(counts)
        self.window = max(1, window)

    def shard_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.shard_count)
        return np.random.default_rng([self.seed, epoch, SHARD_ORDER]).permutation(
            self.shard_count)

    def windows(self, epoch: int) -> list[np.ndarray]:
        """The epoch's windows, each an array of shard positions."""
        order = self.shard_order(epoch)
        return [order[first:first + self.window] for first in range(0, len(order), self.window)]

    def rows_of(self, shards: np.ndarray) -> np.ndarray:
        ranges = [np.arange(self.starts[s], self.starts[s + 1]) for s in shards]
        return np.concatenate(ranges) if ranges else np.zeros(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        parts = [np.random.default_rng([self.seed, epoch, number]).permutation(self.rows_of(shards))
                 for number, shards in enumerate(self.windows(epoch))]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def batches_for(frame, batch_size: int, window: int = DEFAULT_WINDOW, **options
                ) -> ShardedBatches:
    """Windows of shards where the frame's rows are shards' samples (a `shard` column)."""
    if "shard" in frame:
        return WindowedBatches(frame.shard.to_numpy(), batch_size, window=window, **options)
    return ShardedBatches(len(frame), batch_size, **options)

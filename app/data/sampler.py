"""Which images each worker reads at each step.

Step k of an epoch takes the k-th slice of `global_batch` images from a permutation seeded by
(seed, epoch), and worker r takes the r-th contiguous part of that slice. So every image is seen
once per epoch across all workers, N workers x batch b see exactly the images one worker with
batch N*b would, and a run can restart at any step of any epoch with the same batches.
Every image also carries its own augmentation seed, derived from (seed, epoch, index), so the
crops do not depend on which process or worker decodes it.
"""

from __future__ import annotations

import math

import numpy as np

_MASK = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from a few integers (splitmix64 finaliser)."""
    x = 0x9E3779B97F4A7C15
    for value in values:
        x = (x ^ (value & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
        x ^= x >> 31
    return x >> 1


def split_evenly(items: np.ndarray, parts: int, part: int) -> np.ndarray:
    """The `part`-th of `parts` contiguous pieces whose sizes differ by at most one."""
    return np.array_split(items, parts)[part]


class ShardedBatches:
    """Batch sampler (for DataLoader's `batch_sampler`) yielding [(index, aug_seed), ...].

    Train (shuffle=True): steps_per_epoch = ceil(N / global_batch); the last step may be short,
    and with several workers a worker's part of it may even be empty; the gradient sync weights
    each worker by the images it actually had.
    Val (shuffle=False): each worker takes one contiguous slice of the val set, so every image is
    counted exactly once (no padding duplicates).
    """

    def __init__(self, num_items: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        self.num_items = num_items
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_step = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Select the epoch's permutation; `start_step` skips batches already trained on."""
        self.epoch = epoch
        self.start_step = start_step

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def steps_per_epoch(self) -> int:
        if self.shuffle:
            return math.ceil(self.num_items / self.global_batch)
        mine = len(split_evenly(np.arange(self.num_items), self.world_size, self.rank))
        return math.ceil(mine / self.batch_size)

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The epoch's permutation of all items (the selected epoch's by default)."""
        if not self.shuffle:
            return np.arange(self.num_items)
        epoch = self.epoch if epoch is None else epoch
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def items(self, order: np.ndarray, epoch: int, step: int) -> list[tuple[int, int]]:
        """This worker's (index, augmentation seed) pairs of one step, given the epoch's
        order: a pure function, so a reader in another process computes the same batch."""
        if self.shuffle:
            batch = order[step * self.global_batch:(step + 1) * self.global_batch]
            mine = split_evenly(batch, self.world_size, self.rank)
        else:
            part = split_evenly(order, self.world_size, self.rank)
            mine = part[step * self.batch_size:(step + 1) * self.batch_size]
        return [(int(i), mix_seed(self.seed, epoch, int(i))) for i in mine]

    def __len__(self) -> int:
        return self.steps_per_epoch() - self.start_step

    def __iter__(self):
        order = self.order()
        for step in range(self.start_step, self.steps_per_epoch()):
            yield self.items(order, self.epoch, step)

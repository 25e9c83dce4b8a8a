"""Which images each worker reads at each step.

Step k of an epoch takes the k-th slice of `global_batch` images from a permutation seeded by
(seed, epoch), and worker r the r-th contiguous part of it: every image is seen once per epoch,
N workers x batch b see what one worker with batch N*b would, and a run can restart at any step
of any epoch with the same batches. Each image's augmentation seed comes from (seed, epoch,
index), so its crops do not depend on which process decodes it.

Repeated augmentation (torchvision's RASampler, `repetitions` > 1): an epoch takes
1/repetitions of the images, each `repetitions` times with a seed of its own per copy, laid out
so that splitting a global batch among workers puts the copies on different workers.
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


def spread_copies(batch: np.ndarray, repetitions: int) -> np.ndarray:
    """One global batch of samples (`index * repetitions + copy`), all first copies, then all
    second copies, ...: any split into `repetitions` or more equal contiguous parts puts an
    image's copies on different workers (torchvision strides by world size, which would make
    N workers x batch b differ from one worker's batch N*b)."""
    if repetitions == 1:
        return batch
    return batch[np.argsort(batch % repetitions, kind="stable")]


def split_evenly(items: np.ndarray, parts: int, part: int) -> np.ndarray:
    """The `part`-th of `parts` contiguous pieces whose sizes differ by at most one."""
    return np.array_split(items, parts)[part]


class ShardedBatches:
    """Batch sampler (DataLoader's `batch_sampler`) yielding [(index, aug_seed), ...].

    Train: the last step may be short, a worker's part of it even empty (the gradient sync
    weights workers by their images). Val (shuffle=False): each worker takes one contiguous
    slice, so every image counts once. With repetitions, an image whose copies straddle two
    steps, or fall in the last, short step, may have two on one worker.
    """

    def __init__(self, num_items: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, repetitions: int = 1):
        if repetitions < 1 or (repetitions > 1 and not shuffle):
            raise ValueError(f"repetitions must be 1, or more when shuffling; got {repetitions}")
        self.num_items = num_items
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.repetitions = repetitions
        self.epoch = 0
        self.start_step = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """`start_step` skips batches already trained on."""
        self.epoch = epoch
        self.start_step = start_step

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def images_per_epoch(self) -> int:
        """Distinct images an epoch takes, rounded down as torchvision's RASampler trims."""
        return max(1, self.num_items // self.repetitions)

    def steps_per_epoch(self) -> int:
        if self.shuffle:
            return math.ceil(self.images_per_epoch() * self.repetitions / self.global_batch)
        mine = len(split_evenly(np.arange(self.num_items), self.world_size, self.rank))
        return math.ceil(mine / self.batch_size)

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The epoch's samples (the selected epoch's by default), `index * repetitions + copy`:
        with repetitions, the first images of a permutation, each followed by its copies."""
        if not self.shuffle:
            return np.arange(self.num_items)
        epoch = self.epoch if epoch is None else epoch
        images = self.permutation(epoch)[:self.images_per_epoch()]
        return (images[:, None] * self.repetitions + np.arange(self.repetitions)).ravel()

    def permutation(self, epoch: int) -> np.ndarray:
        """Every item once, in the epoch's order (app/data/windows.py orders shards' samples)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def augmentation_seed(self, epoch: int, index: int, copy: int) -> int:
        # the first copy keeps the seed of a run without repetitions
        if copy == 0:
            return mix_seed(self.seed, epoch, index)
        return mix_seed(self.seed, epoch, index, copy)

    def items(self, order: np.ndarray, epoch: int, step: int) -> list[tuple[int, int]]:
        """This worker's (index, augmentation seed) pairs of one step: a pure function, so a
        reader in another process computes the same batch."""
        if self.shuffle:
            batch = order[step * self.global_batch:(step + 1) * self.global_batch]
            mine = split_evenly(spread_copies(batch, self.repetitions), self.world_size,
                                self.rank)
        else:
            part = split_evenly(order, self.world_size, self.rank)
            mine = part[step * self.batch_size:(step + 1) * self.batch_size]
        index, copy = np.divmod(mine, self.repetitions)
        return [(int(i), self.augmentation_seed(epoch, int(i), int(c)))
                for i, c in zip(index, copy)]

    def __len__(self) -> int:
        return self.steps_per_epoch() - self.start_step

    def __iter__(self):
        order = self.order()
        for step in range(self.start_step, self.steps_per_epoch()):
            yield self.items(order, self.epoch, step)

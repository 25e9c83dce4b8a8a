"""The Pillow input pipeline: DataLoader processes read, decode and augment on the CPU; the
training process moves each batch to the device (app/data/device.py).

Images that cannot be read or decoded are skipped and reported with the batch (path and
reason), never dropped silently. Batches may therefore be shorter than the batch size.

Each batch also names the rows its loader process will be handed next (ReadAhead), so the
reader fetches them while this batch decodes; which images form a batch, their order and
their crops stay those of ShardedBatches and the recipe.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import pandas as pd
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from app.catalog.storage import DatasetRoot
from app.data import loader_processes as loaders
from app.data.augment import Plan, Recipe
from app.data.decode import BadImage, open_image, to_rgb
from app.data.device import ToDevice
from app.data.image_ops import apply_ops
from app.data.pipeline import DeviceBatch, PipelineSpec, Skipped
from app.data.sampler import ShardedBatches
from app.data.samples import Sample, open_samples
from app.runtime.errors import UserError, original_error
from app.runtime.moments import moment

READ_AHEAD_BATCHES = 2  # per loader process: its next batches' images are fetched meanwhile


@dataclass
class BatchRequest:
    """What a loader process is asked for: one batch, and the rows of the batches it will be
    asked for next (only a hint for the reader: never part of the batch)."""
    items: list[tuple[int, int]]  # (row, augmentation seed), from ShardedBatches
    upcoming: list[int]
    epoch: int = 0  # picks the recipe's size (progressive resizing)


class ReadAhead:
    """Batch sampler around ShardedBatches that adds to every batch the rows of the next
    `depth` batches the same loader process will get. DataLoader hands batch i to process
    i % processes (round robin, in order; all batches to one when it has none)."""

    def __init__(self, batches: ShardedBatches, processes: int, depth: int = READ_AHEAD_BATCHES):
        self.batches = batches
        self.stride = max(processes, 1)
        self.depth = depth
        self.empty_pass = False  # the next pass asks for nothing (PillowPipeline.open)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[BatchRequest]:
        if self.empty_pass:
            self.empty_pass = False
            return
        batches = iter(self.batches)
        window = deque(itertools.islice(batches, self.depth * self.stride + 1))
        while window:
            current = window.popleft()
            mine_next = itertools.islice(window, self.stride - 1, None, self.stride)
            yield BatchRequest(current, [row for batch in mine_next for row, _ in batch],
                               self.batches.epoch)
            window.extend(itertools.islice(batches, 1))


def apply_on_pil(image: Image.Image, recipe: Recipe, seed: int) -> torch.Tensor:
    """Crop, resize (antialiased bilinear), flip and auto-augment an RGB image -> uint8 tensor
    (S, S, 3)."""
    return apply_plan_on_pil(image, recipe.plan(image.height, image.width, seed), recipe.size)


def apply_plan_on_pil(image: Image.Image, plan: Plan, size: int) -> torch.Tensor:
    """An image's plan, carried out by Pillow -> uint8 tensor (size, size, 3)."""
    top, left, h, w = plan.box
    out = image.resize((size, size), Image.Resampling.BILINEAR,
                       box=(left, top, left + w, top + h))
    if plan.flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    out = apply_ops(out, plan.ops)
    return torch.from_numpy(np.asarray(out).copy())


@dataclass
class HostBatch:
    images: torch.Tensor  # uint8 (n, S, S, 3): NHWC, so the device sees channels_last for free
    labels: torch.Tensor  # int64 (n,)
    skipped: list[Skipped] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.labels)

    def pin_memory(self) -> "HostBatch":  # called by DataLoader(pin_memory=True)
        return HostBatch(self.images.pin_memory(), self.labels.pin_memory(), self.skipped)


class ImageDataset(Dataset):
    """Indexed by (row, augmentation seed) pairs from ShardedBatches; DataLoader hands a whole
    batch (a BatchRequest) to __getitems__, so its blobs are read concurrently, and the ones
    of the next batches meanwhile."""

    def __init__(self, root: DatasetRoot, frame: pd.DataFrame, recipe: Recipe,
                 batches: ShardedBatches):
        self.samples = open_samples(root, frame, batches)
        self.recipe = recipe

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, int]):
        return self.__getitems__([item])[0]

    def __getitems__(self, request: BatchRequest | list[tuple[int, int]]) -> list:
        if not isinstance(request, BatchRequest):
            request = BatchRequest(request, [])
        moment("loader:batch")
        rows = [row for row, _ in request.items]
        samples = self.samples.read(rows, request.upcoming, request.epoch)
        recipe = self.recipe.at_epoch(request.epoch)
        return [self.decode(self.samples.name(row), sample, seed, recipe)
                for row, sample, (_, seed) in zip(rows, samples, request.items)]

    def decode(self, path: str, sample: Sample, seed: int, recipe: Recipe):
        data, reason, label = sample
        if data is None:
            return Skipped(path, reason)
        try:
            return self.prepare(path, data, seed, recipe), torch.tensor(label, dtype=torch.int64)
        except BadImage as error:
            return Skipped(path, str(error))

    def prepare(self, path: str, data: bytes, seed: int, recipe: Recipe):
        """What this process hands over for the image: here its pixels, as the recipe wants
        them; BadImage when the bytes are no usable image."""
        return apply_on_pil(to_rgb(open_image(data)), recipe, seed)


def collate(items: list) -> HostBatch:
    good = [item for item in items if not isinstance(item, Skipped)]
    skipped = [item for item in items if isinstance(item, Skipped)]
    if not good:  # every image of this batch was bad, or this worker's share was empty
        return HostBatch(torch.empty(0, 0, 0, 3, dtype=torch.uint8),
                         torch.empty(0, dtype=torch.int64), skipped)
    return HostBatch(torch.stack([p for p, _ in good]), torch.stack([l for _, l in good]),
                     skipped)


def build_loader(root: DatasetRoot, frame: pd.DataFrame, recipe: Recipe,
                 batches: ShardedBatches, workers: int, pin_memory: bool = False,
                 dataset_type: type[ImageDataset] = ImageDataset,
                 collate_fn: Callable[[list], object] = collate) -> DataLoader:
    """`dataset_type` and `collate_fn`: what the loader processes make of each image and
    batch (decoded pixels here; app/data/encoded.py: bytes for a decoder on the device)."""
    return loaders.data_loader(dataset_type(root, frame, recipe, batches), workers,
                               batch_sampler=ReadAhead(batches, workers),
                               collate_fn=collate_fn, pin_memory=pin_memory)


class PillowPipeline:
    # what the loader processes hand over (subclasses: other work in them, the rest on the device)
    dataset_type: type[ImageDataset] = ImageDataset
    collate_fn = staticmethod(collate)

    def __init__(self, spec: PipelineSpec):
        self.batches = spec.batches
        self.to_device = ToDevice(spec.form)
        self.loader: DataLoader | None = build_loader(
            spec.root, spec.frame, spec.recipe, spec.batches, spec.workers,
            pin_memory=spec.form.device.type == "cuda", dataset_type=self.dataset_type,
            collate_fn=self.collate_fn)

    def open(self, epoch: int, start_step: int = 0) -> None:
        """Start the loader processes now, with a pass that asks for nothing: they fork side by
        side at the start of training, from a worker that has made no object-store request yet
        (app/data/loader_processes.py), and no batch is decoded to be thrown away. Nothing else
        to take in advance: torch's caching allocators grow in the first steps."""
        if self.loader is not None and self.loader.num_workers:
            self.loader.batch_sampler.empty_pass = True
            for _ in self.loader:  # forks the processes; the pass itself is empty
                pass
            loaders.remember_processes(self.loader)

    def steps_per_epoch(self) -> int:
        return self.batches.steps_per_epoch()

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[DeviceBatch]:
        self.batches.set_epoch(epoch, start_step)
        failure = None
        try:
            batches = iter(self.loader)  # the first pass forks the processes (unless open did)
            loaders.remember_processes(self.loader)
            for batch in batches:
                yield self.on_device(batch)
        except UserError as error:  # a damaged shard, met in a loader process
            failure = original_error(error)
        except (OSError, EOFError) as error:  # a batch's pipe or shared memory broke
            death = loaders.dead_loader(wait_s=loaders.DEATH_READABLE_S)
            if death is None:
                raise
            raise loaders.LoaderProcessDied(death) from error
        if failure is not None:
            # Its loader processes end now: left to garbage collection they may not stop
            # before the interpreter exits, whose join would then wait for them forever (they
            # ignore SIGTERM: app/runtime/interrupts.py).
            self.close(at_once=True)
            raise failure

    def on_device(self, batch: HostBatch) -> DeviceBatch:
        images, labels = self.to_device(batch.images, batch.labels)
        return DeviceBatch(images, labels, batch.skipped)

    def close(self, at_once: bool = False) -> None:
        """`at_once` (after a failure): the loader processes are killed rather than asked to
        stop; asked, each is waited for up to 5 s, and one stuck handing over a batch that
        nobody reads any more takes all of them (and then ignores SIGTERM)."""
        if at_once:
            loaders.kill_processes(self.loader)
        self.loader = None  # its persistent worker processes shut down with it

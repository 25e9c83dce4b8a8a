"""The Pillow input pipeline: DataLoader processes read, decode and augment on the CPU; the
training process moves each batch to the device (app/data/device.py).

Images that cannot be read or decoded are skipped and reported with the batch, so a batch may
be short. Each batch also names the rows its loader process gets next (ReadAhead), which the
reader fetches while this batch decodes.
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
from app.runtime.stop_signals import blocked

READ_AHEAD_BATCHES = 2  # per loader process: its next batches' images are fetched meanwhile


@dataclass
class BatchRequest:
    """One batch for a loader process, and the rows it will be asked for next (a hint)."""
    items: list[tuple[int, int]]  # (row, augmentation seed), from ShardedBatches
    upcoming: list[int]
    epoch: int = 0  # picks the recipe's size (progressive resizing)


class ReadAhead:
    """ShardedBatches, each batch with the rows of the next `depth` batches of the same loader
    process (DataLoader hands batch i to process i % processes)."""

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
    """Crop, resize, flip and auto-augment an RGB image -> uint8 tensor (S, S, 3)."""
    return apply_plan_on_pil(image, recipe.plan(image.height, image.width, seed), recipe.size)


def apply_plan_on_pil(image: Image.Image, plan: Plan, size: int) -> torch.Tensor:
    top, left, h, w = plan.box
    out = image.resize((size, size), Image.Resampling.BILINEAR,
                       box=(left, top, left + w, top + h))
    if plan.flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(apply_ops(out, plan.ops)).copy())


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
    """Indexed by (row, augmentation seed); __getitems__ gets a whole BatchRequest, so its
    blobs are read concurrently, and those of the next batches meanwhile."""

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
        """What this process hands over for the image (here its pixels), or BadImage."""
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
    """`dataset_type` and `collate_fn`: what the loader processes make of images and batches."""
    return loaders.data_loader(dataset_type(root, frame, recipe, batches), workers,
                               uses_obstore=root.reader == "obstore",
                               batch_sampler=ReadAhead(batches, workers),
                               collate_fn=collate_fn, pin_memory=pin_memory)


class PillowPipeline:
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
        side from a worker that has made no object-store request yet, and no batch is decoded
        to be thrown away."""
        if self.loader is not None and self.loader.num_workers:
            self.loader.batch_sampler.empty_pass = True
            with blocked():  # forked with the stop signals blocked, until each ignores them
                for _ in self.loader:  # forks the processes; the pass itself is empty
                    pass
            loaders.remember_processes(self.loader)

    def steps_per_epoch(self) -> int:
        return self.batches.steps_per_epoch()

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[DeviceBatch]:
        self.batches.set_epoch(epoch, start_step)
        failure = None
        try:
            with blocked():  # the first pass forks the processes (unless open did)
                batches = iter(self.loader)
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
            # Killed now: left to garbage collection they may outlive the interpreter's exit,
            # whose join would wait for them forever (they ignore SIGTERM).
            self.close(at_once=True)
            raise failure

    def on_device(self, batch: HostBatch) -> DeviceBatch:
        images, labels = self.to_device(batch.images, batch.labels)
        return DeviceBatch(images, labels, batch.skipped)

    def close(self, at_once: bool = False) -> None:
        """`at_once` (after a failure): kill the loader processes rather than ask them to stop
        (each waited for up to 5 s; one stuck handing over a batch then ignores SIGTERM)."""
        if at_once:
            loaders.kill_processes(self.loader)
        self.loader = None  # its persistent worker processes shut down with it

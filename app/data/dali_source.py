"""What DALI's reader processes run: a batch's bytes and each image's crop box, flip and
auto-augment ops from our recipe, so DALI decodes the region the Pillow path would crop.

Picklable, and imports no torch (DALI spawns the processes and imports this module there).
Reads through app/data/samples.py, so every catalog layout works. A bad file never reaches
DALI's decoder, which would fail the whole batch: the header is checked first, and a bad or
missing image travels as a tiny placeholder with its reason, dropped and reported downstream.
"""

from __future__ import annotations

import functools
import io

import numpy as np
import pandas as pd
from PIL import Image

from app.catalog.storage import DatasetRoot
from app.data.augment import Plan, Recipe
from app.data.auto_augment import IDENTITY, OP_NAMES, Ops
from app.data.decode import BadImage, open_complete, to_rgb
from app.data.samples import open_samples
from app.data.sampler import ShardedBatches
from app.runtime.stop_signals import ignore_in_child
from app.runtime.liveness import die_with_parent

NATIVE = {("JPEG", "RGB"), ("JPEG", "L"), ("PNG", "RGB"), ("PNG", "L")}  # DALI == Pillow
OP_IDS = {name: index for index, name in enumerate(OP_NAMES)}


@functools.cache
def placeholder() -> bytes:
    """An 8x8 grey JPEG that stands in for an image that could not be read."""
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (128, 128, 128)).save(buffer, "JPEG")
    return buffer.getvalue()


def prepare(data: bytes) -> tuple[int, int, bytes]:
    """(height, width, bytes for DALI), or BadImage (truncated files too: open_complete). JPEG
    and PNG in RGB or grey go as they are; anything else (CMYK, palette or alpha, other formats
    under a .JPEG name) is decoded by Pillow, as on the Pillow path, into a lossless PNG."""
    image = open_complete(data)
    if (image.format, image.mode) not in NATIVE:
        buffer = io.BytesIO()
        to_rgb(image).save(buffer, "PNG", compress_level=1)
        data = buffer.getvalue()
    return image.height, image.width, data


class BatchSource:
    """DALI external_source callback (batch mode): DALI's epoch `info.epoch_idx` is our epoch
    `first_epoch + epoch_idx`; the first starts at `first_step` (a run resumed mid-epoch)."""

    def __init__(self, root: DatasetRoot, frame: pd.DataFrame, recipe: Recipe,
                 batches: ShardedBatches, first_epoch: int, first_step: int):
        self.samples = open_samples(root, frame, batches)
        self.recipe = recipe
        self.slots = recipe.policy().slots
        self.batches = batches
        self.first_epoch, self.first_step = first_epoch, first_step

    def __setstate__(self, state: dict) -> None:
        """Unpickled in one of DALI's reader processes (spawned): those must outlive the stop
        signals Slurm sends to every process of a job step, until their worker has saved, and
        die with their worker."""
        self.__dict__.update(state)
        die_with_parent()
        ignore_in_child()

    @functools.lru_cache(maxsize=2)  # pure: a permutation per epoch, not per batch
    def order(self, epoch: int) -> np.ndarray:
        return self.batches.order(epoch)

    def __call__(self, info) -> tuple[list[np.ndarray], ...]:
        epoch = self.first_epoch + info.epoch_idx
        step = info.iteration + (self.first_step if info.epoch_idx == 0 else 0)
        if step >= self.batches.steps_per_epoch():
            raise StopIteration  # also for the batches DALI asks for ahead of the epoch's end
        items = self.batches.items(self.order(epoch), epoch, step)
        samples = self.samples.read([index for index, _ in items], epoch=epoch)
        recipe = self.recipe.at_epoch(epoch)
        columns: tuple[list[np.ndarray], ...] = tuple([] for _ in range(10 if self.slots else 8))
        for (index, seed), (data, reason, label) in zip(items, samples):
            for column, value in zip(columns, self.sample(recipe, index, seed, data, reason,
                                                          label)):
                column.append(value)
        return columns

    def sample(self, recipe: Recipe, index: int, seed: int, data: bytes | None,
               reason: str, label: int) -> tuple:
        """Encoded bytes, crop anchor (x, y) and shape (w, h), mirror flag, label, row in the
        table, why it was skipped (UTF-8; empty for a good image), the epoch's output size;
        with auto-augment, the plan's op ids and magnitudes (op_columns)."""
        if data is not None:
            try:
                height, width, data = prepare(data)
                plan = recipe.plan(height, width, seed)
            except BadImage as error:
                data, reason = None, str(error)
        if data is None:
            data, plan = placeholder(), Plan((0, 0, 8, 8), False)
        top, left, h, w = plan.box
        return (np.frombuffer(data, dtype=np.uint8), np.array([left, top], dtype=np.int32),
                np.array([w, h], dtype=np.int32), np.array(int(plan.flip), dtype=np.int32),
                np.array(label, dtype=np.int64), np.array(index, dtype=np.int64),
                np.frombuffer(reason.encode("utf-8"), dtype=np.uint8),
                np.array(recipe.size, dtype=np.float32),
                *(op_columns(plan.ops, self.slots) if self.slots else ()))


def op_columns(ops: Ops, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """A plan's ops as DALI's per-sample inputs: op ids (int32) and magnitudes (float64, the
    plan's own values), padded with Identity to the policy's slots."""
    padded = ops + (IDENTITY,) * (slots - len(ops))
    return (np.array([OP_IDS[name] for name, _ in padded], dtype=np.int32),
            np.array([magnitude for _, magnitude in padded], dtype=np.float64))

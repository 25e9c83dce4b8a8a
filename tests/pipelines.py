"""Helpers for the tests that hold a decoder or its ops against the Pillow path (tests/test_dali*,
tests/test_nvjpeg.py, tests/test_gpu.py): pipelines built on the tiny sample, pixel
differences in levels of 255, damage only a decoder sees, photos and ops to augment."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from app.catalog import tables
from app.catalog.storage import DatasetRoot
from app.catalog.tables import load_tables
from app.data.augment import IMAGENET_STD, EvalRecipe, TrainRecipe
from app.data.auto_augment import WIDE_SPACE
from app.data.decoders import build_pipeline
from app.data.pipeline import InputFormat, PipelineSpec
from app.data.sampler import ShardedBatches



def spec_for(root, frame, recipe, batches, workers=1, form=None) -> PipelineSpec:
    return PipelineSpec(root, frame, recipe, batches, workers,
                        form or InputFormat(torch.device("cpu")))


def batches_of(decoder, spec, epoch, start_step) -> list:
    pipeline = build_pipeline(decoder, spec)
    try:
        return list(pipeline.epoch(epoch, start_step))
    finally:
        pipeline.close()


def level_difference(a: torch.Tensor, b: torch.Tensor,
                     std: tuple[float, ...] = IMAGENET_STD) -> torch.Tensor:
    """|a - b| of two normalised batches, per value, in levels of 255."""
    return ((a - b) * torch.tensor(std, device=a.device).view(1, 3, 1, 1) * 255).abs()


def equalized(root, frame, spec, epoch, step) -> torch.Tensor:
    """Which images of the batch get Equalize: exact on equal pixels, it spreads the decoders'
    small differences of its input over whole levels (DALI's differs from Pillow's besides)."""
    items = spec.batches.items(spec.batches.order(epoch), epoch, step)
    sizes = [Image.open(f"{root.url}/{frame.path[index]}").size for index, _ in items]
    return torch.tensor([any(name == "Equalize" for name, _ in spec.recipe.plan(h, w, seed).ops)
                         for (_, seed), (w, h) in zip(items, sizes)])


def assert_pillows_batches(decoder: str, sample: Path, split: str, auto_augment: str,
                           form: InputFormat | None = None) -> None:
    """Epoch 2 from step 1 on, whole (so the sample's CMYK, grey and PNG-named-.JPEG files are
    among them), through `decoder` and through Pillow: the same images and labels in the same
    order, as float32 in the model's layout, pixels within the DALI tests' tolerance (1.0 of
    255 on average over a batch; 3.0 on an image, 6.0 with auto-augment), images that get
    Equalize left out. `form`: other normalisation statistics than ImageNet's."""
    root = DatasetRoot("tiny", str(sample))
    frame = getattr(load_tables(root), split)
    recipe = TrainRecipe(32, auto_augment=auto_augment) if split == "train" else EvalRecipe(32)
    spec = spec_for(root, frame, recipe, ShardedBatches(len(frame), 24, seed=1,
                                                        shuffle=split == "train"), form=form)
    pillow = batches_of("pillow", spec, epoch=2, start_step=1)
    ours = batches_of(decoder, spec, epoch=2, start_step=1)
    assert len(ours) == len(pillow) == spec.batches.steps_per_epoch() - 1
    image_mean = 3.0 if auto_augment == "off" else 6.0
    for step, (a, b) in enumerate(zip(pillow, ours), start=1):
        assert torch.equal(a.labels, b.labels) and a.images.shape == b.images.shape
        assert b.images.dtype == torch.float32 and b.images.is_contiguous() and not b.skipped
        pixels = level_difference(a.images, b.images, spec.form.std)[
            ~equalized(root, frame, spec, 2, step)]
        assert pixels.mean() <= 1.0 and pixels.mean(dim=(1, 2, 3)).max() <= image_mean


def damage_five(copy: Path, truncated_to: slice) -> tuple:
    """Five train images of a copy of the tiny sample damaged, four in the first batch of 64
    (seed 0) and one in the third: (root, frame, batches, {kind: path}); kinds "empty",
    "text" (not an image), "huffman" (a header that looks fine), "missing" and "truncated"
    (its bytes cut to `truncated_to`)."""
    root = DatasetRoot("t", str(copy))
    frame = load_tables(root).train
    batches = ShardedBatches(len(frame), 64, seed=0)
    first = [index for index, _ in next(iter(batches))]
    later = [index for index, _ in list(iter(batches))[2]][5]
    paths = {kind: frame.path[index] for kind, index in zip(
        ("empty", "text", "huffman", "missing", "truncated"), (*first[:4], later))}
    (copy / paths["empty"]).write_bytes(b"")
    (copy / paths["text"]).write_text("<html>403</html>")
    corrupt_huffman_tables(copy / paths["huffman"])
    (copy / paths["missing"]).unlink()
    (copy / paths["truncated"]).write_bytes((copy / paths["truncated"]).read_bytes()[truncated_to])
    return root, frame, batches, paths


def corrupt_huffman_tables(path: Path) -> None:
    """A JPEG whose header is fine but whose Huffman counts are not: only a decoder sees it
    (DALI fails the whole batch on it; Pillow calls it a broken data stream)."""
    data = bytearray(path.read_bytes())
    table = data.find(b"\xff\xc4")
    data[table + 5:table + 21] = b"\xff" * 16
    path.write_bytes(bytes(data))


def sample_photos(sample: Path, size: int) -> list[Image.Image]:
    """A few of the sample's train images as a plan leaves them: RGB, `size` px square."""
    paths = sorted((sample / tables.TRAIN_DIR).rglob("*.JPEG"))[3:40:9]
    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR))
    return images


def wide_ops(bins: tuple[int, ...] = (4, 15, 30)) -> list[tuple]:
    """Every op of TrivialAugmentWide at these bins of its widest range (both signs where
    signed), and AutoAugment's Invert."""
    ops = [("Invert", 0.0)]
    for name, magnitudes in WIDE_SPACE:
        if magnitudes is None:
            ops.append((name, 0.0))
            continue
        for index in bins:
            value = magnitudes.at(index, 31)
            ops += [(name, value), (name, -value)] if magnitudes.signed else [(name, value)]
    return ops

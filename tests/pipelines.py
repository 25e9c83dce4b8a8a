"""Helpers for the tests that hold a decoder or its ops against the Pillow path (tests/test_dali*,
tests/test_nvjpeg.py, tests/test_gpu.py): pipelines built on the tiny sample, pixel
differences in levels of 255, damage only a decoder sees, photos and ops to augment."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from app.catalog import tables
from app.data.auto_augment import WIDE_SPACE
from app.data.decoders import build_pipeline
from app.data.pipeline import InputFormat, PipelineSpec

STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255  # normalised -> pixels


def spec_for(root, frame, recipe, batches, workers=1, form=None) -> PipelineSpec:
    return PipelineSpec(root, frame, recipe, batches, workers,
                        form or InputFormat(torch.device("cpu")))


def batches_of(decoder, spec, epoch, start_step) -> list:
    pipeline = build_pipeline(decoder, spec)
    try:
        return list(pipeline.epoch(epoch, start_step))
    finally:
        pipeline.close()


def level_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| of two normalised batches, per value, in levels of 255."""
    return ((a - b) * STD.to(a.device)).abs()


def equalized(root, frame, spec, epoch, step) -> torch.Tensor:
    """Which images of the batch get Equalize: exact on equal pixels, it spreads the decoders'
    small differences of its input over whole levels (DALI's differs from Pillow's besides)."""
    items = spec.batches.items(spec.batches.order(epoch), epoch, step)
    sizes = [Image.open(f"{root.url}/{frame.path[index]}").size for index, _ in items]
    return torch.tensor([any(name == "Equalize" for name, _ in spec.recipe.plan(h, w, seed).ops)
                         for (_, seed), (w, h) in zip(items, sizes)])


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


def wide_ops() -> list[tuple]:
    """Every op of TrivialAugmentWide at bins 4, 15 and 30 (both signs where signed), and
    AutoAugment's Invert."""
    ops = [("Invert", 0.0)]
    for name, magnitudes in WIDE_SPACE:
        if magnitudes is None:
            ops.append((name, 0.0))
            continue
        for index in (4, 15, 30):
            value = magnitudes.at(index, 31)
            ops += [(name, value), (name, -value)] if magnitudes.signed else [(name, value)]
    return ops

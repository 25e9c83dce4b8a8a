"""DALI's auto-augment ops against the Pillow path's (torchvision's functional ops) on the same
pixels: real sample images as a plan leaves them (cropped, resized), every op of
TrivialAugmentWide (and AutoAugment's Invert) at a few magnitudes of both signs, all in one
batch, so DALI's conditionals pick a different op per sample.

Tolerances per op, in levels of 255 (measured, in parentheses):
- exact (0): Identity, TranslateX/Y, Brightness, Color, Contrast, Sharpness, Posterize,
  Solarize, AutoContrast, Invert; DALI's side computes what Pillow's C code computes.
- ShearX/Y, Rotate: every value within 1, at most 5% of them off by 1 (here <= 0.12%; 2.7% on
  other sample images): DALI maps coordinates in float32, Pillow in float64, so a bilinear
  weight may truncate the other way.
- Equalize: DALI's fn.equalize uses OpenCV's lookup table, not Pillow's (app/data/dali_ops.py):
  mean difference <= 8 (here 5.0, at most 14 on a value). Which images get it, and how often,
  is the plan's, tested with the policies (tests/test_auto_augment.py).
"""

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("nvidia.dali")  # noqa: E402

from nvidia.dali import fn, pipeline_def  # noqa: E402

from app.data.auto_augment import OP_NAMES  # noqa: E402
from app.data.dali_ops import augment  # noqa: E402
from app.data.dali_source import op_columns  # noqa: E402
from app.data.image_ops import apply_ops  # noqa: E402
from pipelines import sample_photos, wide_ops  # noqa: E402

SIZE = 64
EXACT = {"Identity", "TranslateX", "TranslateY", "Brightness", "Color", "Contrast", "Sharpness",
         "Posterize", "Solarize", "AutoContrast", "Invert"}
GEOMETRIC = {"ShearX", "ShearY", "Rotate"}


@pytest.fixture(scope="module")
def photos(tiny_sample) -> list[Image.Image]:
    return sample_photos(tiny_sample, SIZE)


def run_dali(images: list[np.ndarray], plans: list[tuple], slots: int, device: str) -> list:
    """One batch through augment(): sample i is images[i] with the ops plans[i]."""
    columns = [op_columns(ops, slots) for ops in plans]

    @pipeline_def(enable_conditionals=True, batch_size=len(images), num_threads=1,
                  device_id=0 if device == "gpu" else None)
    def pipe():
        pixels = fn.external_source(source=lambda: images, batch=True, layout="HWC")
        ids = fn.external_source(source=lambda: [c[0] for c in columns], batch=True)
        magnitudes = fn.external_source(source=lambda: [c[1] for c in columns], batch=True)
        return augment(pixels.gpu() if device == "gpu" else pixels, ids, magnitudes, slots)

    built = pipe()
    built.build()
    (out,) = built.run()
    out = out.as_cpu() if device == "gpu" else out
    return [np.asarray(out.at(i)) for i in range(len(images))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_dali_applies_each_op_as_pillow_does(photos, device):
    cases = [(photo, op) for op in wide_ops() for photo in photos]
    assert {op[0] for _, op in cases} == set(OP_NAMES)
    ours = run_dali([np.asarray(photo) for photo, _ in cases], [(op,) for _, op in cases], 1,
                    device)
    for (photo, (name, magnitude)), dali in zip(cases, ours):
        pillow = np.asarray(apply_ops(photo, ((name, magnitude),)))
        difference = np.abs(pillow.astype(np.int16) - dali.astype(np.int16))
        where = (name, magnitude)
        if name in EXACT:
            assert difference.max() == 0, where
        elif name in GEOMETRIC:
            assert difference.max() <= 1 and (difference > 0).mean() <= 0.05, where
        else:  # Equalize: OpenCV's table on DALI's side
            assert difference.mean() <= 8, where


def test_two_ops_per_image_run_in_order_and_identity_pads(photos):
    """RandAugment and AutoAugment give up to two ops; a plan with fewer is padded."""
    plans = [(("Posterize", 3.0), ("Color", 0.5)), (("Solarize", 100.0), ("Brightness", -0.3)),
             (("Contrast", 0.7),), (), (("TranslateY", -9.0), ("Invert", 0.0))]
    images = [photos[i % len(photos)] for i in range(len(plans))]
    ours = run_dali([np.asarray(image) for image in images], plans, 2, "cpu")
    for image, ops, dali in zip(images, plans, ours):
        assert np.array_equal(np.asarray(apply_ops(image, ops)), dali), ops

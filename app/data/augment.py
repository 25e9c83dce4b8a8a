"""Train and eval recipes: where to crop, whether to flip, which auto-augment ops, and the
normalisation's statistics.

Plans come from the image size and a per-image seed, so every decoder applies the same recipe.
Plain Python: DALI's reader processes import this module and have no use for torch.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from app.config.schema import IMAGENET_MEAN, IMAGENET_STD  # noqa: F401 (the default statistics)
from app.data.auto_augment import Ops, Policy, policy
from app.data.resolution import DEFAULT_CROP_FRACTION, TrainSizes

Box = tuple[int, int, int, int]  # top, left, height, width
TRAIN_CROPS = ("random-resized", "shorter-side")  # the flag's choices


@dataclass(frozen=True)
class Plan:
    """Crop `box` (resized to the recipe's size), mirror when `flip`, then apply `ops`."""
    box: Box
    flip: bool
    ops: Ops = ()


def random_resized_crop_box(height: int, width: int, rng: random.Random,
                            scale: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> Box:
    """A box covering `scale` of the area with aspect in `ratio` (torchvision's algorithm:
    ten tries, then a centre crop clamped to the ratio range)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def shorter_side_box(height: int, width: int, rng: random.Random) -> Box:
    """A square of the shorter side, at a random place along the longer one: the whole photo
    but for a strip of its longer side (fastai's Resize with its default crop method)."""
    side = min(height, width)
    return rng.randint(0, height - side), rng.randint(0, width - side), side, side


def center_crop_box(height: int, width: int, crop_fraction: float) -> Box:
    """Resize-shorter-side-then-centre-crop, expressed as one box in the original image."""
    side = max(1, round(min(height, width) * crop_fraction))
    return (height - side) // 2, (width - side) // 2, side, side


@dataclass(frozen=True)
class TrainRecipe:
    """RandomResizedCrop (or with crop="shorter-side" a square of the shorter side) +
    horizontal flip + auto-augment, in torchvision's order (normalisation happens on the
    device). `size` is the crop's; with `sizes` (progressive resizing) it is the first epoch's,
    and `at_epoch` gives each epoch's recipe."""
    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    crop: str = "random-resized"  # TRAIN_CROPS
    auto_augment: str = "off"  # app/data/auto_augment.py AUTO_AUGMENT
    ra_magnitude: int = 9
    sizes: TrainSizes | None = None

    @classmethod
    def for_sizes(cls, sizes: TrainSizes, **options) -> "TrainRecipe":
        return cls(sizes.at(0), sizes=sizes if sizes.progressive else None, **options)

    def at_epoch(self, epoch: int) -> "TrainRecipe":
        if self.sizes is None:
            return self
        return dataclasses.replace(self, size=self.sizes.at(epoch))

    def plan(self, height: int, width: int, seed: int) -> Plan:
        rng = random.Random(seed)
        box = (shorter_side_box(height, width, rng) if self.crop == "shorter-side"
               else random_resized_crop_box(height, width, rng, self.scale, self.ratio))
        flip = rng.random() < 0.5
        # drawn last: the crop and flip stay those of a run without auto-augment
        return Plan(box, flip, self.policy().draw(rng))

    def policy(self) -> Policy:
        return policy(self.auto_augment, self.size, self.ra_magnitude)


@dataclass(frozen=True)
class EvalRecipe:
    """Resize the shorter side to size / crop_fraction, then centre-crop size x size."""
    size: int
    crop_fraction: float = DEFAULT_CROP_FRACTION

    def at_epoch(self, epoch: int) -> "EvalRecipe":
        return self

    def plan(self, height: int, width: int, seed: int) -> Plan:
        return Plan(center_crop_box(height, width, self.crop_fraction), False)

    def policy(self) -> Policy:
        return policy("off", self.size)


Recipe = TrainRecipe | EvalRecipe

"""Auto-augment policies as torchvision defines them (TrivialAugmentWide, RandAugment,
AutoAugment's ImageNet policy), reduced to what a plan needs: the ops an image gets and their
signed magnitudes, drawn from the image's own random stream. Plain Python (DALI's reader
processes import it). A magnitude is the value torchvision's `_apply_op` takes for the op:
app/data/image_ops.py and app/data/dali_ops.py apply it."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Protocol

Op = tuple[str, float]  # (torchvision's op name, signed magnitude)
Ops = tuple[Op, ...]

# Every op any policy uses; an op's index here is its id on DALI's side.
OP_NAMES = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness",
            "Color", "Contrast", "Sharpness", "Posterize", "Solarize", "AutoContrast",
            "Equalize", "Invert")
IDENTITY: Op = ("Identity", 0.0)


@dataclass(frozen=True)
class Linear:
    """Magnitudes from 0 at bin 0 to `high` at the last bin, negated half the time."""
    high: float
    # Translations, truncated to whole pixels as torchvision does; its float32 bins may land
    # just below a whole number (TA-wide's bin 15: 15 px), here the exact value (16 px).
    whole: bool = False
    signed = True

    def at(self, index: int, bins: int) -> float:
        value = self.high * index / (bins - 1)
        return float(int(value)) if self.whole else value


@dataclass(frozen=True)
class Bits:
    """Posterize: 8 bits kept at bin 0, `fewest` at the last bin."""
    fewest: int
    signed = False

    def at(self, index: int, bins: int) -> float:
        return float(8 - round(index / ((bins - 1) / (8 - self.fewest))))


@dataclass(frozen=True)
class Threshold:
    """Solarize: pixels at or above the threshold are inverted; 255 at bin 0, 0 at the last."""
    signed = False

    def at(self, index: int, bins: int) -> float:
        return 255.0 * (bins - 1 - index) / (bins - 1)


Magnitudes = Linear | Bits | Threshold | None  # None: the op takes no magnitude
Space = tuple[tuple[str, Magnitudes], ...]  # ordered: an op is drawn by its position

# TrivialAugmentWide's ops and ranges.
WIDE_SPACE: Space = (
    ("Identity", None), ("ShearX", Linear(0.99)), ("ShearY", Linear(0.99)),
    ("TranslateX", Linear(32.0, whole=True)), ("TranslateY", Linear(32.0, whole=True)),
    ("Rotate", Linear(135.0)), ("Brightness", Linear(0.99)), ("Color", Linear(0.99)),
    ("Contrast", Linear(0.99)), ("Sharpness", Linear(0.99)), ("Posterize", Bits(2)),
    ("Solarize", Threshold()), ("AutoContrast", None), ("Equalize", None))


@functools.cache
def standard_space(size: int) -> Space:
    """RandAugment's and AutoAugment's ops (each adds Identity or Invert); translations scale
    with the (square) image, as in the AutoAugment paper."""
    shift = 150.0 / 331.0 * size
    return (("ShearX", Linear(0.3)), ("ShearY", Linear(0.3)),
            ("TranslateX", Linear(shift, whole=True)), ("TranslateY", Linear(shift, whole=True)),
            ("Rotate", Linear(30.0)), ("Brightness", Linear(0.9)), ("Color", Linear(0.9)),
            ("Contrast", Linear(0.9)), ("Sharpness", Linear(0.9)), ("Posterize", Bits(4)),
            ("Solarize", Threshold()), ("AutoContrast", None), ("Equalize", None))


def signed(name: str, magnitudes: Magnitudes, index: int | None, bins: int,
           rng: random.Random) -> Op:
    """The op with its magnitude at bin `index`, negated when a coin says so (signed ops)."""
    if magnitudes is None:
        return name, 0.0
    value = magnitudes.at(index, bins)
    return name, -value if magnitudes.signed and rng.random() < 0.5 else value


class Policy(Protocol):
    slots: int  # the most ops one image gets

    def draw(self, rng: random.Random) -> Ops: ...


@dataclass(frozen=True)
class NoAutoAugment:
    slots = 0

    def draw(self, rng: random.Random) -> Ops:
        return ()


@dataclass(frozen=True)
class TrivialAugmentWide:
    """One op, uniformly; a magnitude bin, uniformly."""
    bins: int = 31
    slots = 1

    def draw(self, rng: random.Random) -> Ops:
        name, magnitudes = rng.choice(WIDE_SPACE)
        index = rng.randrange(self.bins) if magnitudes is not None else None
        return (signed(name, magnitudes, index, self.bins, rng),)


@dataclass(frozen=True)
class RandAugment:
    """`num_ops` ops, each uniformly (repeats allowed), all at bin `magnitude`."""
    size: int
    magnitude: int = 9
    num_ops: int = 2
    bins: int = 31

    @property
    def slots(self) -> int:
        return self.num_ops

    def draw(self, rng: random.Random) -> Ops:
        space = (("Identity", None), *standard_space(self.size))
        return tuple(signed(name, magnitudes, self.magnitude, self.bins, rng)
                     for name, magnitudes in (rng.choice(space) for _ in range(self.num_ops)))


# AutoAugment's ImageNet policy: 25 sub-policies of two (op, probability, magnitude bin of 10).
IMAGENET_POLICY = (
    (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
    (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
    (("Equalize", 0.4, None), ("Rotate", 0.8, 8)),
    (("Solarize", 0.6, 3), ("Equalize", 0.6, None)),
    (("Posterize", 0.8, 5), ("Equalize", 1.0, None)),
    (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)),
    (("Equalize", 0.6, None), ("Posterize", 0.4, 6)),
    (("Rotate", 0.8, 8), ("Color", 0.4, 0)),
    (("Rotate", 0.4, 9), ("Equalize", 0.6, None)),
    (("Equalize", 0.0, None), ("Equalize", 0.8, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
    (("Color", 0.8, 8), ("Solarize", 0.8, 7)),
    (("Sharpness", 0.4, 7), ("Invert", 0.6, None)),
    (("ShearX", 0.6, 5), ("Equalize", 1.0, None)),
    (("Color", 0.4, 0), ("Equalize", 0.6, None)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
)


@dataclass(frozen=True)
class ImageNetAutoAugment:
    """A sub-policy, uniformly; each of its two ops applies with its probability."""
    size: int
    bins: int = 10
    slots = 2

    def draw(self, rng: random.Random) -> Ops:
        space = dict(standard_space(self.size), Invert=None)
        return tuple(signed(name, space[name], index, self.bins, rng)
                     for name, probability, index in rng.choice(IMAGENET_POLICY)
                     if rng.random() < probability)


AUTO_AUGMENT = ("off", "ta_wide", "ra", "imagenet")  # the flag's choices


@functools.cache
def policy(name: str, size: int, ra_magnitude: int = 9) -> Policy:
    """The policy named by --auto-augment for images of `size` pixels."""
    if name == "ta_wide":
        return TrivialAugmentWide()
    if name == "ra":
        return RandAugment(size, ra_magnitude)
    if name == "imagenet":
        return ImageNetAutoAugment(size)
    if name == "off":
        return NoAutoAugment()
    raise ValueError(f"unknown auto-augment policy {name!r}; known: {', '.join(AUTO_AUGMENT)}")

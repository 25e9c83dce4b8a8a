"""Auto-augment's ops, each as torchvision's functional op (v2, which takes a PIL image or a
uint8 (3, H, W) tensor on any device), called the way torchvision's auto-augment classes call
them: with the interpolation its training recipe passes (bilinear) and fill 0 outside the image.
The Pillow path applies them to PIL images in its loader processes, the nvJPEG path to tensors
on the training device (app/data/nvjpeg_pipeline.py).

On tensors, measured against the PIL results on sample images (tests/test_nvjpeg.py): identical
for Identity, the translations, Brightness, Sharpness, Posterize, Solarize, Equalize and
Invert; within 1 level for Color, Contrast (a blend rounded where Pillow truncates) and
AutoContrast; Shear and Rotate differ along the image's edges, where torchvision's tensor
kernel blends the fill into the border pixels and Pillow's does not (about 1 level on average
over an image).
"""

from __future__ import annotations

import math
from typing import Callable, TypeVar

import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

from app.data.auto_augment import Ops

BILINEAR = InterpolationMode.BILINEAR
Picture = TypeVar("Picture", Image.Image, torch.Tensor)


def shear(image: Picture, factor: float, axis: int) -> Picture:
    """torchvision takes shear as an angle; the magnitude is the factor (its tangent). The
    origin is the top-left corner, as in the AutoAugment paper's code."""
    angles = [0.0, 0.0]
    angles[axis] = math.degrees(math.atan(factor))
    return F.affine(image, angle=0.0, translate=[0, 0], scale=1.0, shear=angles,
                    interpolation=BILINEAR, center=[0, 0])


def translate(image: Picture, pixels: float, axis: int) -> Picture:
    """What F.affine(image, translate=int(pixels)) gives. On a PIL image without its per-pixel
    bilinear transform: a whole-pixel shift samples every output pixel exactly on an input
    pixel, so it is a shifted copy on black (torchvision's default fill). Measured at 224 px:
    2.1 ms for F.affine, ~0.1 ms for the copy; bit-identical (tests/test_auto_augment.py)."""
    shift = [0, 0]
    shift[axis] = int(pixels)
    if isinstance(image, torch.Tensor):  # one kernel on the device: nothing to save
        return F.affine(image, angle=0.0, translate=shift, scale=1.0, shear=[0.0, 0.0],
                        interpolation=BILINEAR)
    out = Image.new(image.mode, image.size)
    out.paste(image, tuple(shift))
    return out


OPS: dict[str, Callable[[Picture, float], Picture]] = {
    "Identity": lambda image, m: image,
    "ShearX": lambda image, m: shear(image, m, 0),
    "ShearY": lambda image, m: shear(image, m, 1),
    "TranslateX": lambda image, m: translate(image, m, 0),
    "TranslateY": lambda image, m: translate(image, m, 1),
    "Rotate": lambda image, m: F.rotate(image, m, interpolation=BILINEAR),
    "Brightness": lambda image, m: F.adjust_brightness(image, 1.0 + m),
    "Color": lambda image, m: F.adjust_saturation(image, 1.0 + m),
    "Contrast": lambda image, m: F.adjust_contrast(image, 1.0 + m),
    "Sharpness": lambda image, m: F.adjust_sharpness(image, 1.0 + m),
    "Posterize": lambda image, m: F.posterize(image, int(m)),
    "Solarize": lambda image, m: F.solarize(image, m),
    "AutoContrast": lambda image, m: F.autocontrast(image),
    "Equalize": lambda image, m: F.equalize(image),
    "Invert": lambda image, m: F.invert(image),
}


def apply_ops(image: Picture, ops: Ops) -> Picture:
    for name, magnitude in ops:
        image = OPS[name](image, magnitude)
    return image

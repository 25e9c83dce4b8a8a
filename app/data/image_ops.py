"""Auto-augment's ops as torchvision's functional ops (v2: a PIL image, or a uint8 (3, H, W)
tensor on any device), called as its auto-augment classes call them (bilinear, fill 0): the
Pillow path applies them in its loader processes, the nvJPEG path on the training device.

Where torchvision's tensor kernels differ from Pillow's code, the tensor side computes what
Pillow does, so both paths give the same pixels (tests/test_nvjpeg.py). On a GPU nothing here
makes a tensor from host values (a copy the host would wait for): Python scalars instead.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, TypeVar

import numpy as np
import torch
from PIL import Image

from app.data.auto_augment import Ops

Picture = TypeVar("Picture", Image.Image, torch.Tensor)


@functools.cache
def tv():
    """torchvision's v2 functional ops, imported at the first op: torchvision pulls in
    torch._dynamo, seconds of CPU in every Pillow loader process, most of which never apply one."""
    from torchvision.transforms.v2 import functional  # noqa: PLC0415
    return functional


def bilinear():
    from torchvision.transforms import InterpolationMode  # noqa: PLC0415
    return InterpolationMode.BILINEAR


def shear(image: Picture, factor: float, axis: int) -> Picture:
    """The magnitude is the factor (the angle's tangent), the origin the top-left corner."""
    angles = [0.0, 0.0]
    angles[axis] = math.degrees(math.atan(factor))
    if isinstance(image, torch.Tensor):
        # torchvision's output -> input matrix for this shear: the factor, as it computes it
        slope = math.tan(math.radians(angles[axis]))
        return pil_affine(image, (1.0, slope, 0.0, 0.0, 1.0, 0.0) if axis == 0 else
                          (1.0, 0.0, 0.0, slope, 1.0, 0.0))
    return tv().affine(image, angle=0.0, translate=[0, 0], scale=1.0, shear=angles,
                       interpolation=bilinear(), center=[0, 0])


def shifted(image: torch.Tensor, dx: int, dy: int) -> torch.Tensor:
    """A (3, H, W) tensor moved by whole pixels on black: slices, no matrix from the host."""
    _, height, width = image.shape
    out = torch.zeros_like(image)
    if abs(dx) < width and abs(dy) < height:
        out[:, max(dy, 0):height + min(dy, 0), max(dx, 0):width + min(dx, 0)] = \
            image[:, max(-dy, 0):height - max(dy, 0), max(-dx, 0):width - max(dx, 0)]
    return out


def rotate(image: Picture, degrees: float) -> Picture:
    """Counter-clockwise about the image's centre, as Pillow's Image.rotate."""
    if not isinstance(image, torch.Tensor):
        return tv().rotate(image, degrees, interpolation=bilinear())
    _, height, width = image.shape
    angle = -math.radians(degrees)
    cos, sin = round(math.cos(angle), 15), round(math.sin(angle), 15)  # as Pillow rounds them
    centre_x, centre_y = width / 2, height / 2
    return pil_affine(image, (cos, sin, centre_x - cos * centre_x - sin * centre_y,
                              -sin, cos, centre_y + sin * centre_x - cos * centre_y))


def pil_affine(image: torch.Tensor, matrix: tuple[float, ...]) -> torch.Tensor:
    """Pillow's bilinear affine transform on a uint8 (3, H, W) tensor: `matrix` (a, b, c, d, e,
    f) maps each output pixel's centre (x, y) to the input point (a x + b y + c, d x + e y + f);
    outside the image 0, inside its neighbours (clamped) blended in float64 and truncated, as
    Pillow's C code does (torchvision's kernel blends the fill into the edges and rounds)."""
    _, height, width = image.shape
    a, b, c, d, e, f = matrix
    ys = torch.arange(height, dtype=torch.float64, device=image.device).add_(0.5).view(-1, 1)
    xs = torch.arange(width, dtype=torch.float64, device=image.device).add_(0.5).view(1, -1)
    x_in, y_in = a * xs + b * ys + c, d * xs + e * ys + f
    inside = (x_in >= 0) & (x_in < width) & (y_in >= 0) & (y_in < height)
    x_in, y_in = x_in - 0.5, y_in - 0.5
    left, top = x_in.floor(), y_in.floor()
    dx, dy = x_in - left, y_in - top
    left, top = left.long(), top.long()
    x0, x1 = left.clamp(0, width - 1), (left + 1).clamp(0, width - 1)
    y0, y1 = top.clamp(0, height - 1), (top + 1).clamp(0, height - 1)
    pixels = image.double()
    upper = pixels[:, y0, x0] + (pixels[:, y0, x1] - pixels[:, y0, x0]) * dx
    lower = pixels[:, y1, x0] + (pixels[:, y1, x1] - pixels[:, y1, x0]) * dx
    out = (upper + (lower - upper) * dy).trunc_()
    return torch.where(inside, out, 0.0).to(torch.uint8)


def translate(image: Picture, pixels: float, axis: int) -> Picture:
    """What F.affine(image, translate=int(pixels)) gives, as a shifted copy on black: a
    whole-pixel shift samples every output pixel on an input pixel, so the copy is
    bit-identical and far cheaper than the bilinear transform (tests/test_auto_augment.py)."""
    shift = [0, 0]
    shift[axis] = int(pixels)
    if isinstance(image, torch.Tensor):
        return shifted(image, *shift)
    out = Image.new(image.mode, image.size)
    out.paste(image, tuple(shift))
    return out


def luma(image: torch.Tensor) -> torch.Tensor:
    """Pillow's RGB -> L of a uint8 (3, H, W) tensor: (1, H, W) int32, 16-bit fixed point."""
    red, green, blue = image.int().split(1)
    return torch.bitwise_right_shift(red * 19595 + green * 38470 + blue * 7471 + 32768, 16)


def blend(degenerate: torch.Tensor, image: torch.Tensor, offset: float) -> torch.Tensor:
    """Pillow's Image.blend(degenerate, image, 1 + offset) (ImageEnhance): its C loop in
    float32, clipped and truncated, the factor rounded to float32 as Pillow's C takes it."""
    factor = float(np.float32(1.0 + offset))
    out = degenerate.float() + (image.int() - degenerate).float() * factor
    return out.clamp_(0, 255).to(torch.uint8)


def color(image: Picture, offset: float) -> Picture:
    if not isinstance(image, torch.Tensor):
        return tv().adjust_saturation(image, 1.0 + offset)
    return blend(luma(image), image, offset)


def contrast(image: Picture, offset: float) -> Picture:
    """Towards the image's mean luma, rounded half up (Pillow's ImageStat in float64)."""
    if not isinstance(image, torch.Tensor):
        return tv().adjust_contrast(image, 1.0 + offset)
    return blend(luma(image).double().mean().add(0.5).floor().int(), image, offset)


def sharpness(image: Picture, offset: float) -> Picture:
    """Away from ImageFilter.SMOOTH (3x3: 1s around a 5, over 13; rounded, the 1-pixel border
    kept). On a tensor in integers: a float convolution may run in TF32 on a GPU, and
    torchvision's kernel comes from the host. The sum over 13 is never within 1/26 of a half,
    so Pillow's float32 rounding and this exact one agree."""
    if not isinstance(image, torch.Tensor):
        return tv().adjust_sharpness(image, 1.0 + offset)
    _, height, width = image.shape
    if min(height, width) < 3:
        return image
    pixels = image.int()
    window = sum(pixels[:, dy:height - 2 + dy, dx:width - 2 + dx]
                 for dy in range(3) for dx in range(3))
    weighted = window + 4 * pixels[:, 1:-1, 1:-1]
    degenerate = pixels.clone()
    degenerate[:, 1:-1, 1:-1] = torch.div(2 * weighted + 13, 26, rounding_mode="floor")
    return blend(degenerate, image, offset)


def autocontrast(image: Picture) -> Picture:
    """Each channel stretched from its lowest to its highest value by Pillow's lookup table
    (float64, truncated); a flat one left as is."""
    if not isinstance(image, torch.Tensor):
        return tv().autocontrast(image)
    low = image.amin(dim=(1, 2), keepdim=True).double()
    high = image.amax(dim=(1, 2), keepdim=True).double()
    # tensor / tensor: one IEEE division (torch's scalar / tensor rounds twice)
    scale = torch.full_like(low, 255.0) / (high - low).clamp(min=1)
    stretched = (image.double() * scale + -low * scale).trunc_().clamp_(0, 255)
    return torch.where(high <= low, image, stretched.to(torch.uint8))


OPS: dict[str, Callable[[Picture, float], Picture]] = {
    "Identity": lambda image, m: image,
    "ShearX": lambda image, m: shear(image, m, 0),
    "ShearY": lambda image, m: shear(image, m, 1),
    "TranslateX": lambda image, m: translate(image, m, 0),
    "TranslateY": lambda image, m: translate(image, m, 1),
    "Rotate": rotate,
    "Brightness": lambda image, m: tv().adjust_brightness(image, 1.0 + m),
    "Color": color,
    "Contrast": contrast,
    "Sharpness": sharpness,
    "Posterize": lambda image, m: tv().posterize(image, int(m)),
    "Solarize": lambda image, m: tv().solarize(image, m),
    "AutoContrast": lambda image, m: autocontrast(image),
    "Equalize": lambda image, m: tv().equalize(image),
    "Invert": lambda image, m: tv().invert(image),
}


def apply_ops(image: Picture, ops: Ops) -> Picture:
    for name, magnitude in ops:
        image = OPS[name](image, magnitude)
    return image

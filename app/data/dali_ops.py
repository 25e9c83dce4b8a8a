"""DALI's side of auto-augment: the ops of app/data/auto_augment.py with the Pillow path's
semantics, selected per sample by the op id and magnitude the reader hands over for each slot.

Selection uses DALI conditionals (`enable_conditionals=True`): `if op_id <= mid` splits the
batch, so each sample runs only its own op (a binary tree of the ops, as in DALI's auto_aug).
Where DALI's operators differ from Pillow (rounding, luma, the affine fill, the sharpness
filter's border) they are rebuilt from arithmetic so pixels match. Equalize alone differs: DALI's
`fn.equalize` (OpenCV's lookup table, counting up to and including each level; Pillow's counts
up to the level before and rounds otherwise) is a few levels off on most pixels. Images are
uint8 HWC; magnitudes float64 (factors then round to float32 as Pillow's C code rounds them).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali import math as dmath
from nvidia.dali.data_node import DataNode

from app.data.auto_augment import OP_NAMES

# Pillow's luma weights in 16-bit fixed point (its RGB -> L conversion).
LUMA = np.array([19595, 38470, 7471], dtype=np.int32)
SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=np.float32) / 13  # ImageFilter.SMOOTH
POSTERIZE_MASKS = [255 ^ (2 ** (8 - bits) - 1) for bits in range(9)]  # bits kept -> mask


def augment(images: DataNode, op_ids: DataNode, magnitudes: DataNode, slots: int) -> DataNode:
    """Each sample through its plan's ops: `op_ids` (int32) and `magnitudes` (float64) hold
    `slots` entries per sample, padded with Identity."""
    for slot in range(slots):
        images = select(images, op_ids[slot], magnitudes[slot], 0, len(OP_NAMES) - 1)
    return images


def select(images: DataNode, op_id: DataNode, magnitude: DataNode, low: int, high: int
           ) -> DataNode:
    """OPS[op_id](images, magnitude) for the samples whose op id is in [low, high]."""
    if low == high:
        return OPS[OP_NAMES[low]](images, magnitude)
    middle = (low + high) // 2
    if op_id <= middle:
        out = select(images, op_id, magnitude, low, middle)
    else:
        out = select(images, op_id, magnitude, middle + 1, high)
    return out


def to_uint8(values: DataNode) -> DataNode:
    """Pillow's float -> 8 bits: truncated, saturated (DALI's cast alone would round)."""
    return fn.cast(dmath.floor(values), dtype=types.UINT8)


# --- geometric ops: Pillow's affine sampling -------------------------------------------------

def warp(images: DataNode, matrix: DataNode) -> DataNode:
    """Pillow's transform (output -> input matrix): bilinear, neighbours clamped to the image,
    0 where the point falls outside. DALI's fill would blend 0 into the edge pixels, so a
    nearest-neighbour warp of ones masks a clamped warp; floats, truncated as Pillow does."""
    ones = fn.cast(images[:, :, 0:1] * 0 + 1, dtype=types.UINT8)
    inside = fn.warp_affine(ones, matrix=matrix, fill_value=0, interp_type=types.INTERP_NN)
    pixels = fn.warp_affine(images, matrix=matrix, interp_type=types.INTERP_LINEAR,
                            dtype=types.FLOAT)
    return to_uint8(pixels * inside)


def along(magnitude: DataNode, axis: int) -> DataNode:
    """(m, 0) or (0, m) as float32: a per-sample argument of DALI's transforms."""
    unit = np.zeros(2, dtype=np.float32)
    unit[axis] = 1
    return fn.cast(magnitude * types.Constant(unit), dtype=types.FLOAT)


def shear(images: DataNode, factor: DataNode, axis: int) -> DataNode:
    # torchvision's inverse matrix for shear (origin at the top-left corner) is a shear by +m
    return warp(images, fn.transforms.shear(shear=along(factor, axis)))


def translate(images: DataNode, pixels: DataNode, axis: int) -> DataNode:
    return warp(images, fn.transforms.translation(offset=along(-pixels, axis)))


def rotate(images: DataNode, degrees: DataNode) -> DataNode:
    """About Pillow's centre (width / 2, height / 2); a positive angle is counter-clockwise on
    screen, whose output -> input matrix is DALI's rotation by that angle."""
    shape = images.shape(dtype=types.FLOAT)
    centre = fn.stack(shape[1], shape[0]) * 0.5
    return warp(images, fn.transforms.rotation(angle=fn.cast(degrees, dtype=types.FLOAT),
                                               center=centre))


# --- colour ops: Pillow's ImageEnhance and ImageOps ---------------------------------------

def blend(degenerate: DataNode, images: DataNode, offset: DataNode) -> DataNode:
    """Pillow's Image.blend(degenerate, image, 1 + offset): float32, truncated, as its C."""
    factor = fn.cast(offset + 1.0, dtype=types.FLOAT)
    return to_uint8(degenerate + factor * (fn.cast(images, dtype=types.INT32) - degenerate))


def luma(images: DataNode) -> DataNode:
    """Pillow's RGB -> L, (HW1) int32: fixed-point weights, rounded."""
    weighted = fn.cast(images, dtype=types.INT32) * types.Constant(LUMA)
    total = fn.reductions.sum(weighted, axis_names="C", keep_dims=True)
    return fn.cast((total + 32768) // 65536, dtype=types.INT32)


def mean_luma(images: DataNode) -> DataNode:
    """ImageEnhance.Contrast's grey: the mean luma, rounded half up (float64: ImageStat)."""
    shape = images.shape(dtype=types.FLOAT64)
    total = fn.cast(fn.reductions.sum(luma(images)), dtype=types.FLOAT64)
    return fn.cast(dmath.floor(total / (shape[0] * shape[1]) + 0.5), dtype=types.INT32)


def smooth(images: DataNode) -> DataNode:
    """ImageEnhance.Sharpness's degenerate image: ImageFilter.SMOOTH, rounded, with the
    1-pixel border left as it was (Pillow filters only where the 3x3 window fits)."""
    ones = fn.cast(images[:, :, 0:1] * 0 + 1, dtype=types.UINT8)
    box = types.Constant(np.ones((3, 3), dtype=np.float32), device=images.device)
    window = fn.filter(ones, box, border="constant", dtype=types.FLOAT)
    inner = window > 8.5  # all nine neighbours inside the image
    kernel = types.Constant(SMOOTH, device=images.device)
    smoothed = dmath.floor(fn.filter(images, kernel, dtype=types.FLOAT) + 0.5)
    return fn.cast(inner * smoothed + (inner ^ True) * images, dtype=types.INT32)


def posterize(images: DataNode, bits: DataNode) -> DataNode:
    mask = fn.lookup_table(fn.cast(bits, dtype=types.INT32), keys=list(range(9)),
                           values=POSTERIZE_MASKS, dtype=types.UINT8)
    return images & mask


def solarize(images: DataNode, threshold: DataNode) -> DataNode:
    keep = images < threshold
    return fn.cast(keep * images + (keep ^ True) * (255 - images), dtype=types.UINT8)


def autocontrast(images: DataNode) -> DataNode:
    """ImageOps.autocontrast: per channel, lowest -> 0 and highest -> 255 by Pillow's lookup
    table (float64, truncated); a flat channel stays."""
    low = fn.cast(fn.reductions.min(images, axis_names="HW", keep_dims=True), dtype=types.FLOAT64)
    high = fn.cast(fn.reductions.max(images, axis_names="HW", keep_dims=True),
                   dtype=types.FLOAT64)
    flat = high <= low
    scale = 255.0 / (high - low + flat)
    stretched = fn.cast(images, dtype=types.FLOAT64) * scale - low * scale
    return to_uint8(flat * images + (flat ^ True) * stretched)


def invert(images: DataNode) -> DataNode:
    return types.Constant(255, dtype=types.UINT8) - images


OPS: dict[str, Callable[[DataNode, DataNode], DataNode]] = {
    "Identity": lambda images, m: images,
    "ShearX": lambda images, m: shear(images, m, 0),
    "ShearY": lambda images, m: shear(images, m, 1),
    "TranslateX": lambda images, m: translate(images, m, 0),
    "TranslateY": lambda images, m: translate(images, m, 1),
    "Rotate": lambda images, m: rotate(images, m),
    "Brightness": lambda images, m: blend(types.Constant(0, dtype=types.INT32), images, m),
    "Color": lambda images, m: blend(luma(images), images, m),
    "Contrast": lambda images, m: blend(mean_luma(images), images, m),
    "Sharpness": lambda images, m: blend(smooth(images), images, m),
    "Posterize": posterize,
    "Solarize": solarize,
    "AutoContrast": lambda images, m: autocontrast(images),
    # differs from Pillow: OpenCV's lookup table (see the module's docstring)
    "Equalize": lambda images, m: fn.equalize(images),
    "Invert": lambda images, m: invert(images),
}
assert tuple(OPS) == OP_NAMES  # an op id indexes both

"""Smaller copies of images for `bin/make_shards.py --shorter-side N` (as fast.ai made its
imagenette2-160 and -320): the shorter side brought down to N px. Images already that small, and
bytes Pillow cannot decode (the trainer skips and lists those), stay as they are."""

from __future__ import annotations

import io

from PIL import Image

JPEG_QUALITY = 90  # fast.ai's archives and most re-encoded ImageNet copies are 90-95


def shrink(data: bytes, shorter_side: int) -> bytes:
    """The image re-encoded in its own format with its shorter side at `shorter_side` px."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if min(width, height) <= shorter_side:
                return data
            scale = shorter_side / min(width, height)
            size = (max(1, round(width * scale)), max(1, round(height * scale)))
            kind = image.format
            image.draft("RGB", size)  # JPEG: decode at 1/2, 1/4 or 1/8 size, far faster
            if kind == "JPEG":
                smaller = image.convert("RGB").resize(size, Image.Resampling.LANCZOS)
                options = {"quality": JPEG_QUALITY}
            else:
                smaller, options = image.resize(size, Image.Resampling.LANCZOS), {}
            out = io.BytesIO()
            smaller.save(out, format=kind, **options)
            return out.getvalue()
    except (OSError, ValueError, Image.DecompressionBombError):
        return data

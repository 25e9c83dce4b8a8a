"""Image bytes -> an RGB Pillow image (the CPU decoder). Pillow handles ImageNet's quirks: CMYK
JPEGs (Adobe inversion included), grayscale JPEGs, the PNG under a .JPEG name."""

from __future__ import annotations

import io
import warnings

from PIL import Image

from app.runtime.errors import first_line

# Decoding errors that mean "this file is not a usable image" rather than a bug here.
BAD_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
JPEG_SCAN, JPEG_END = b"\xff\xda", b"\xff\xd9"
PNG_END = b"IEND\xaeB`\x82"


class BadImage(Exception):
    """The bytes are not a decodable image; the message says why."""


def open_image(data: bytes) -> Image.Image:
    """Lazily opened image: its size is known, its pixels are not decoded yet."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except (*BAD_IMAGE_ERRORS, Image.DecompressionBombWarning) as error:
        raise BadImage(_reason(error, data)) from None


TRUNCATED = {"JPEG": "not decodable: truncated (no end of image after the last scan)",
             "PNG": "not decodable: truncated PNG (no IEND chunk at its end)"}


def open_complete(data: bytes) -> Image.Image:
    """open_image, and a truncated file refused from its bytes alone: the GPU decoders may
    fill its missing part with grey instead of failing as Pillow does."""
    image = open_image(data)
    if image.format in TRUNCATED and not ends_whole(image, data):
        raise BadImage(TRUNCATED[image.format])
    return image


def ends_whole(image: Image.Image, data: bytes) -> bool:
    """A JPEG's (or MPO's) end of image marker after its last scan, a PNG's IEND chunk (false
    too for a whole file whose end marker alone is damaged, which Pillow decodes)."""
    if image.format in ("JPEG", "MPO"):
        return JPEG_END in data[data.rfind(JPEG_SCAN):]
    if image.format == "PNG":
        return data.rstrip(b"\0").endswith(PNG_END)
    return True


def to_rgb(image: Image.Image) -> Image.Image:
    """Decode the pixels and convert to RGB (raises BadImage for truncated/corrupt data)."""
    try:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except BAD_IMAGE_ERRORS as error:
        raise BadImage(_reason(error, b"?")) from None


def _reason(error: Exception, data: bytes) -> str:
    if not data:
        return "empty file"
    return f"not decodable: {first_line(error, 120)}"

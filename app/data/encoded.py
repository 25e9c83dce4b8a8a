"""What the nvJPEG pipeline's loader processes hand over: a batch's JPEG bytes, undecoded, with
each image's plan, so the training process decodes the batch in one call on its device
(app/data/nvjpeg_pipeline.py). Reading and batch order are the Pillow pipeline's.

Bytes the device decoder must not see take the Pillow path here: a file that does not end whole
(a GPU decoder may fill it with grey instead of failing) and an image nvJPEG decodes unlike
Pillow (CMYK and other modes, a PNG under a .JPEG name), so their pixels and skips are exactly
the Pillow path's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.data.augment import Plan, Recipe
from app.data.decode import ends_whole, open_image, to_rgb
from app.data.pillow_pipeline import ImageDataset, apply_on_pil
from app.data.pipeline import Skipped

# (Pillow's format, mode) that nvJPEG decodes to Pillow's RGB: YCbCr and greyscale JPEGs (MPO:
# a camera's JPEG with extra frames after the first, which both decode)
ON_DEVICE = {("JPEG", "RGB"), ("JPEG", "L"), ("MPO", "RGB")}


@dataclass(frozen=True)
class Encoded:
    """One image for the device: its bytes and what to do once decoded."""
    path: str
    data: bytes
    plan: Plan
    size: int  # the recipe's output size this epoch


class EncodedDataset(ImageDataset):
    def prepare(self, path: str, data: bytes, seed: int, recipe: Recipe):
        image = open_image(data)
        if (image.format, image.mode) not in ON_DEVICE or not ends_whole(image, data):
            return apply_on_pil(to_rgb(image), recipe, seed)  # or BadImage: skipped
        return Encoded(path, data, recipe.plan(image.height, image.width, seed), recipe.size)


@dataclass
class EncodedBatch:
    """A batch as it crosses from a loader process: every tensor one piece of shared memory."""
    data: torch.Tensor  # uint8 (total,): the JPEGs for the device, one after the other
    lengths: list[int]  # bytes of each JPEG
    plans: list[Plan]  # of each JPEG
    paths: list[str]  # of each JPEG: should the device decoder refuse one, it is reported
    pixels: torch.Tensor  # uint8 (m, S, S, 3): the images Pillow did here, NHWC
    on_device: list[bool]  # per image of the batch, in order: a JPEG (True) or in `pixels`
    labels: torch.Tensor  # int64 (n,), in the batch's order
    size: int  # output size of the JPEGs' plans
    skipped: list[Skipped] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.labels)

    def pin_memory(self) -> "EncodedBatch":  # called by DataLoader(pin_memory=True)
        return EncodedBatch(self.data.pin_memory(), self.lengths, self.plans, self.paths,
                            self.pixels.pin_memory(), self.on_device, self.labels.pin_memory(),
                            self.size, self.skipped)


def collate_encoded(items: list) -> EncodedBatch:
    good = [item for item in items if not isinstance(item, Skipped)]
    skipped = [item for item in items if isinstance(item, Skipped)]
    jpegs = [payload for payload, _ in good if isinstance(payload, Encoded)]
    done = [payload for payload, _ in good if not isinstance(payload, Encoded)]
    # one buffer for the batch's bytes: one piece of shared memory, not one per image
    data = torch.frombuffer(bytearray(b"".join(jpeg.data for jpeg in jpegs)), dtype=torch.uint8) \
        if jpegs else torch.empty(0, dtype=torch.uint8)
    pixels = torch.stack(done) if done else torch.empty(0, 0, 0, 3, dtype=torch.uint8)
    labels = torch.stack([label for _, label in good]) if good else \
        torch.empty(0, dtype=torch.int64)
    return EncodedBatch(data, [len(jpeg.data) for jpeg in jpegs], [jpeg.plan for jpeg in jpegs],
                        [jpeg.path for jpeg in jpegs], pixels,
                        [isinstance(payload, Encoded) for payload, _ in good], labels,
                        jpegs[0].size if jpegs else 0, skipped)

"""What a DALI pipeline's JPEG decoder reserves, sized for each split, and the image size it
preallocates for (no DALI import here, so gpu-check and the tests can state it anywhere).

The mixed decoder preallocates, when the pipeline is built, one device buffer of
`device_memory_padding` bytes and two pinned host buffers of `host_memory_padding` per thread;
a worker holds a train and a val pipeline for the whole run. A buffer too small for an image is
no error: nvJPEG grows it and keeps that size (docs/training.md gives the sums). Train keeps
NVIDIA's ImageNet values, so the training loop never reallocates; val, a short pass, DALI's
defaults. Threads: no more than the batch's images (a thread decodes one image of a batch; one
beyond the batch size would hold buffers and never decode).

The preallocation hint is the largest width and height among the headers of a seeded sample of
the split's images (`largest_image`), not ImageNet's largest (GBs per pipeline, measured);
an image beyond it makes nvJPEG grow that buffer once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from app.catalog.storage import SHARD_LAYOUTS, DatasetRoot
from app.data.decode import BadImage, open_image
from app.data.reader import BlobReader

# NVIDIA's values for ImageNet: the biggest image (5980 x 6430) decodes without reallocation.
IMAGENET_DEVICE_PADDING = 211_025_920
IMAGENET_HOST_PADDING = 140_544_512
# DALI 2.4's defaults for decoders.image_slice, spelled out: the sums hold if a DALI changes them
DALI_DEVICE_PADDING = 16 * 2**20
DALI_HOST_PADDING = 8 * 2**20
IMAGENET_LARGEST = (5980, 6430)  # width, height: the hint NVIDIA's examples use (an upper bound)
HINT_SAMPLE = 512  # images whose headers set the hint
PADDINGS = {"train": (IMAGENET_DEVICE_PADDING, IMAGENET_HOST_PADDING),
            "val": (DALI_DEVICE_PADDING, DALI_HOST_PADDING)}


@dataclass(frozen=True)
class DecoderMemory:
    threads: int
    device_padding: int  # bytes: one GPU buffer per thread
    host_padding: int  # bytes: two pinned host buffers per thread

    @property
    def device_bytes(self) -> int:
        return self.threads * self.device_padding

    @property
    def pinned_bytes(self) -> int:
        return 2 * self.threads * self.host_padding

    def decoder_options(self) -> dict:
        """The mixed decoder's arguments (the CPU decoder has no such buffers)."""
        return {"device_memory_padding": self.device_padding,
                "host_memory_padding": self.host_padding}


def decoder_memory(split: str, batch_size: int, threads: int) -> DecoderMemory:
    """For one pipeline of `split` ("train" or "val") with up to `threads` threads."""
    device_padding, host_padding = PADDINGS[split]
    return DecoderMemory(max(1, min(threads, batch_size)), device_padding, host_padding)


def largest_image(root: DatasetRoot, paths: Sequence[str], sample: int = HINT_SAMPLE,
                  seed: int = 0) -> tuple[int, int]:
    """(width, height): the largest among the headers of a seeded `sample` of `paths`, capped
    at ImageNet's largest; unreadable files are passed over. Shard layouts keep ImageNet's
    bound: a header there costs fetching its whole shard."""
    if root.layout in SHARD_LAYOUTS:
        return IMAGENET_LARGEST
    chosen = random.Random(seed).sample(list(paths), min(sample, len(paths)))
    width = height = 0
    for data, _ in BlobReader(root).read_many(chosen):
        if data is None:
            continue
        try:
            image = open_image(data)  # the header only
        except BadImage:
            continue
        width, height = max(width, image.width), max(height, image.height)
    if not width:
        return IMAGENET_LARGEST
    return min(width, IMAGENET_LARGEST[0]), min(height, IMAGENET_LARGEST[1])

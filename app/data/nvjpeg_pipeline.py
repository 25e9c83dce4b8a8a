"""The nvJPEG input pipeline: nothing to install beyond torch and torchvision. Loader processes
read each batch's bytes and plan every image (app/data/encoded.py); the training process decodes
the JPEGs in one `decode_jpeg(list, device=...)` call (nvJPEG on a GPU, libjpeg-turbo on a CPU,
which is how the tests cover it), then crops, resizes, flips and auto-augments each image there.

Bad data never ends a run: should nvJPEG fail a batch (it fails it whole), each image is decoded
alone, and one it still refuses is decoded by Pillow, or skipped. A failure of the machine
rather than the image takes the same slow way, named in one warning.

On a GPU the decode runs on a stream of its own, which the training stream waits for (an
event, no host wait): torchvision takes its outputs' memory from the current stream's pool and
writes them from its decoder's stream without ordering the two, so that pool holds only decoded
images, each marked as used by the training stream, and a block is reused only once the work
that read it is done. The host waits for the decode (torchvision syncs its stream): data wait.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable

import torch
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

from app.data.augment import Plan
from app.data.decode import BadImage, open_image, to_rgb
from app.data.device import ToDevice
from app.data.encoded import EncodedBatch, EncodedDataset, collate_encoded
from app.data.image_ops import apply_ops
from app.data.pillow_pipeline import PillowPipeline, apply_plan_on_pil
from app.data.pipeline import DeviceBatch, PipelineSpec, Skipped
from app.runtime.errors import first_line

log = logging.getLogger("imagenet_dp")


# A decoder failure that is the machine's, not the image's: (a marker of its message, cause)
NOT_THE_IMAGE = (("not compiled with nvJPEG", "this torchvision was built without nvJPEG"),
                 ("out of memory", "the GPU is out of memory"),
                 ("Failed to initialize nvjpeg", "nvJPEG did not start"),
                 ("Failed to create", "nvJPEG did not start"),
                 ("CUDA error", "a CUDA error"))
Trouble = Callable[[RuntimeError, str], None]  # (the failure, what is done instead)


def decode_jpegs(jpegs: list[torch.Tensor], device: torch.device,
                 trouble: Trouble = lambda error, instead: None) -> list[torch.Tensor | None]:
    """(3, H, W) uint8 images on `device`, None where the decoder refused one: the batch in
    one call, image by image only when that call fails; `trouble` hears of each failure."""
    if not jpegs:
        return []
    try:
        return _decode(jpegs, device)
    except RuntimeError as error:
        trouble(error, "decoding the batch's images one by one")
        return [_decode_one(jpeg, device, trouble) for jpeg in jpegs]


def _decode_one(jpeg: torch.Tensor, device: torch.device, trouble: Trouble
                ) -> torch.Tensor | None:
    try:
        return _decode([jpeg], device)[0]
    except RuntimeError as error:
        trouble(error, "Pillow decodes the images in the training process, slowly")
        return None


def _decode(jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    # torchvision 0.29 deprecates its decoders in favour of TorchCodec (not a dependency here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device)


def not_the_image(error: RuntimeError) -> str | None:
    if isinstance(error, torch.OutOfMemoryError):
        return "the GPU is out of memory"
    return next((cause for marker, cause in NOT_THE_IMAGE if marker in str(error)), None)


def carry_out(image: torch.Tensor, plan: Plan, size: int) -> torch.Tensor:
    """An image's plan on a (3, H, W) uint8 tensor -> (3, size, size) uint8."""
    top, left, h, w = plan.box
    out = F.resize(image[:, top:top + h, left:left + w], [size, size],
                   interpolation=InterpolationMode.BILINEAR, antialias=True)
    if plan.flip:
        out = F.horizontal_flip(out)
    return apply_ops(out, plan.ops)


class DeviceDecoder:
    """An EncodedBatch -> a DeviceBatch, decoded and augmented on the training device."""

    def __init__(self, to_device: ToDevice):
        self.to_device = to_device
        self.device = to_device.form.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.warned: set[tuple[str, str]] = set()  # (cause, what is done instead)

    def __call__(self, batch: EncodedBatch) -> DeviceBatch:
        """The JPEGs decoded here and the loader's Pillow images, in the batch's order."""
        done = iter(batch.pixels.to(self.device, non_blocking=True).permute(0, 3, 1, 2))
        made = iter(self.decode(batch))
        images, kept, skipped = [], [], list(batch.skipped)
        for index, on_device in enumerate(batch.on_device):
            image = next(made) if on_device else next(done)
            if isinstance(image, Skipped):
                skipped.append(image)
                continue
            images.append(image)
            kept.append(index)
        labels = batch.labels
        if len(kept) < len(labels):  # pinned again, so the copy below stays asynchronous
            labels = labels[kept].pin_memory() if self.stream else labels[kept]
        stacked = torch.stack(images) if images else \
            torch.empty(0, 3, 0, 0, dtype=torch.uint8, device=self.device)
        return DeviceBatch(self.to_device.normalise(stacked),
                           labels.to(self.device, non_blocking=True), skipped)

    def decode(self, batch: EncodedBatch) -> list[torch.Tensor | Skipped]:
        jpegs = list(torch.split(batch.data, batch.lengths)) if batch.lengths else []
        return [carry_out(image, plan, batch.size) if image is not None
                else self.with_pillow(jpeg, plan, batch.size, path)
                for jpeg, image, plan, path in zip(jpegs, self.decode_on_device(jpegs),
                                                   batch.plans, batch.paths)]

    def decode_on_device(self, jpegs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """decode_jpegs, ordered before the training stream's work (the module's docstring)."""
        if self.stream is None:
            return decode_jpegs(jpegs, self.device, self.trouble)
        with torch.cuda.stream(self.stream):
            images = decode_jpegs(jpegs, self.device, self.trouble)
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_stream(self.stream)
        for image in images:
            if image is not None:
                image.record_stream(consumer)
        return images

    def trouble(self, error: RuntimeError, instead: str) -> None:
        """One warning per cause and consequence of a failure of the machine, not an image."""
        cause = not_the_image(error)
        if cause and (cause, instead) not in self.warned:
            self.warned.add((cause, instead))
            log.warning("nvJPEG failed on %s: %s (%s); %s (should it last, --decoder pillow "
                        "decodes in the loader processes instead)", self.device, cause,
                        first_line(error, 160), instead)

    def with_pillow(self, jpeg: torch.Tensor, plan: Plan, size: int, path: str
                    ) -> torch.Tensor | Skipped:
        try:
            pixels = apply_plan_on_pil(to_rgb(open_image(jpeg.numpy().tobytes())), plan, size)
        except BadImage as error:
            return Skipped(path, str(error))
        log.info("nvJPEG could not decode %s; Pillow did", path)
        return pixels.to(self.device).permute(2, 0, 1)


class NvjpegPipeline(PillowPipeline):
    """The Pillow pipeline, bytes instead of pixels out of its loaders, decoded on the device."""
    dataset_type = EncodedDataset
    collate_fn = staticmethod(collate_encoded)

    def __init__(self, spec: PipelineSpec):
        super().__init__(spec)
        self.decoder = DeviceDecoder(self.to_device)

    def on_device(self, batch: EncodedBatch) -> DeviceBatch:
        return self.decoder(batch)


"""What a DALI pipeline's JPEG decoder reserves, sized for each split (no DALI import here, so
gpu-check and the tests can state it anywhere).

DALI's mixed decoder preallocates, when the pipeline is built, one device buffer of
`device_memory_padding` bytes per thread and two pinned host buffers of `host_memory_padding`
bytes per thread (double buffering; the documentation of `decoders.image_slice`). One pipeline
therefore reserves

    GPU:          threads x device padding
    pinned host:  2 x threads x host padding

and a training worker holds two pipelines, train and val, for the whole run. A buffer too small
for an image is not an error: nvJPEG reallocates it to fit, and it keeps that size.

- Train keeps NVIDIA's ImageNet values (DeepLearningExamples' and DALI's own ResNet-50 examples),
  sized for ImageNet's largest image: the training loop never reallocates, and its whole
  reservation is made at build, before the first step.
- Val takes DALI's own defaults. Its pass runs once per epoch over ~4% as many images as train
  (50,000 against 1.28 million), so a reallocation there costs a few allocations per epoch,
  not a stall per step. At 8 threads it reserves 128 MiB on the GPU and 128 MiB pinned instead
  of 1.57 GiB and 2.09 GiB. Its buffers can only grow towards the size of the largest val image
  seen, so what it can grow to is bounded by train's formula for its threads.
- Threads: no more than the batch's images. DALI hands a batch's images to its threads, one
  image per task, so a thread beyond the batch size never decodes, yet would hold its buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

# NVIDIA's values for ImageNet: the biggest image (5980 x 6430) decodes without reallocation.
IMAGENET_DEVICE_PADDING = 211_025_920
IMAGENET_HOST_PADDING = 140_544_512
# DALI 2.4's documented defaults for decoders.image_slice (16 MiB and 8 MiB), spelled out so the
# formula stays true if a later DALI changes them.
DALI_DEVICE_PADDING = 16 * 2**20
DALI_HOST_PADDING = 8 * 2**20
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
    """The decoder's threads and per-thread buffers for one pipeline of `split` ("train" or
    "val") decoding batches of `batch_size` images with up to `threads` threads."""
    device_padding, host_padding = PADDINGS[split]
    return DecoderMemory(max(1, min(threads, batch_size)), device_padding, host_padding)

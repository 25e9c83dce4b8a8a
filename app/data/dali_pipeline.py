"""The DALI input pipeline: our recipe, NVIDIA's engine.

Reader processes (app/data/dali_source.py) hand DALI each image's bytes, crop box, flip and
auto-augment ops from the recipe's plan(), so order and augmentation stay functions of (seed,
epoch, image) and exact resume holds. DALI decodes just that region (`decoders.image_slice`;
"mixed" on a GPU), resizes it antialiased (Pillow's filter), runs the ops (app/data/dali_ops.py)
after the flip, torchvision's order, and normalises straight to float.

A bad image arrives as a placeholder with a reason, dropped and reported as the Pillow path
does. Should DALI still fail a batch, it is redone through the Pillow path (which skips the bad
file, or raises a damaged shard's error) and the pipeline is rebuilt from the next step.
"""

from __future__ import annotations

import logging
import math
from typing import Iterator

import torch
from nvidia.dali import Pipeline, fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import feed_ndarray

from app.data.dali_memory import decoder_memory, largest_image
from app.data.dali_ops import augment
from app.data.dali_source import BatchSource
from app.data.device import ToDevice
from app.data.pillow_pipeline import BatchRequest, ImageDataset, collate
from app.data.pipeline import DeviceBatch, PipelineSpec, Skipped
from app.runtime.errors import first_line
from app.runtime.stop_signals import blocked

log = logging.getLogger("imagenet_dp")

# bytes, anchor, shape, mirror, label, row, reason, output size
READER_TYPES = [types.UINT8, types.INT32, types.INT32, types.INT32, types.INT64, types.INT64,
                types.UINT8, types.FLOAT]
OPS_TYPES = [types.INT32, types.FLOAT64]  # with auto-augment: op ids, magnitudes
BATCHES_AHEAD = 2  # per reader process


class DaliPipeline:
    def __init__(self, spec: PipelineSpec, hw_decoder_load: float = 1.0):
        self.spec = spec
        self.hw_decoder_load = hw_decoder_load
        self.pipe: Pipeline | None = None
        self.next: tuple[int, int] | None = None  # (epoch, step) the built pipeline delivers
        self.fallback: ImageDataset | None = None
        self.to_device = ToDevice(spec.form)  # for batches redone through Pillow
        split = "train" if spec.batches.shuffle else "val"  # a fixed order: the evaluation
        self.memory = decoder_memory(split, spec.batches.batch_size, spec.workers)
        self.largest = largest_image(spec.root, spec.frame.path) if \
            spec.form.device.type == "cuda" else None  # only the mixed decoder preallocates
        if self.largest:
            log.info("DALI (%s): the decoder preallocates for %d x %d, the largest of a sample "
                     "of the images", split, *self.largest)

    def steps_per_epoch(self) -> int:
        return self.spec.batches.steps_per_epoch()

    def open(self, epoch: int, start_step: int = 0) -> None:
        """Builds the pipeline that delivers `start_step` of `epoch` first, unless built: its
        threads, reader processes and the decoder's preallocated buffers exist from here on."""
        epoch = self.pass_of(epoch)
        if self.next != (epoch, start_step):
            self.build(epoch, start_step)

    def pass_of(self, epoch: int) -> int:
        return epoch if self.spec.batches.shuffle else 0  # every val pass is the same

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[DeviceBatch]:
        epoch = self.pass_of(epoch)
        self.open(epoch, start_step)
        for step in range(start_step, self.steps_per_epoch()):
            stream = self.consumer_stream()
            try:
                outputs = self.pipe.run(stream)  # positional: DALI 2.4's run(cuda_stream, /)
            except StopIteration:
                raise
            except Exception as error:  # noqa: BLE001 (DALI's RuntimeError; a reader's bare
                # Exception for a damaged shard, which the Pillow redo raises as it is)
                log.warning("DALI failed step %d of epoch %d (%s); redoing it with Pillow",
                            step, epoch + 1, what_failed(error))
                batch = self.redo_with_pillow(epoch, step)
                self.build(epoch, step + 1)
            else:
                batch = self.to_batch(*outputs, stream, self.spec.recipe.at_epoch(epoch).size)
            self.next = (epoch, step + 1)
            yield batch
        self.end_epoch(epoch)

    def build(self, epoch: int, step: int) -> None:
        self.close()
        spec = self.spec
        source = BatchSource(spec.root, spec.frame, spec.recipe, spec.batches, epoch, step)
        device = spec.form.device
        on_gpu = device.type == "cuda"
        slots = spec.recipe.policy().slots
        # DALI conditionals (an op per sample) exist only in graphs defined by pipeline_def
        define = pipeline_def(self.graph, enable_conditionals=slots > 0)
        self.pipe = define(batch_size=max(1, spec.batches.batch_size),
                           num_threads=self.memory.threads,
                           device_id=(device.index or 0) if on_gpu else None,
                           py_num_workers=max(1, math.ceil(spec.workers / 2)),
                           py_start_method="spawn", prefetch_queue_depth=2,
                           source=source, on_gpu=on_gpu, slots=slots)
        with blocked():  # its reader processes start with the stop signals blocked
            self.pipe.build()
        self.next = (epoch, step)

    def graph(self, source: BatchSource, on_gpu: bool, slots: int) -> tuple:
        dtypes = READER_TYPES + (OPS_TYPES if slots else [])
        jpegs, anchors, shapes, mirror, labels, rows, reasons, size, *ops = fn.external_source(
            source=source, num_outputs=len(dtypes), batch=True, batch_info=True, parallel=True,
            prefetch_queue_depth=BATCHES_AHEAD, dtype=dtypes)
        images = fn.decoders.image_slice(
            jpegs, anchors, shapes, output_type=types.RGB, axis_names="WH",
            normalized_anchor=False, normalized_shape=False, adjust_orientation=False,
            **(self.gpu_decoder() if on_gpu else {"device": "cpu"}))
        # the size comes per sample from the source: progressive resizing needs no rebuild
        images = fn.resize(images, resize_x=size, resize_y=size,
                           interp_type=types.INTERP_LINEAR, antialias=True)
        if slots:  # the geometric ops do not commute with the flip: flip first
            images = augment(fn.flip(images, horizontal=mirror), *ops, slots)
            mirror = 0
        images = fn.crop_mirror_normalize(
            images, mirror=mirror, dtype=types.FLOAT, output_layout=self.layout(),
            mean=[m * 255 for m in self.spec.form.mean],
            std=[s * 255 for s in self.spec.form.std])
        return images, labels.gpu() if on_gpu else labels, rows, reasons

    def layout(self) -> str:
        """HWC is channels_last NCHW once permuted, for free; else CHW, written directly."""
        return "HWC" if self.spec.form.channels_last else "CHW"

    def gpu_decoder(self) -> dict:
        """`hw_decoder_load` 1.0: every image the hardware decoder can take goes there, whatever
        its batch; `affine=False` leaves the cores unpinned for the machine's other workers;
        fancy upsampling decodes chroma like libjpeg-turbo, so like Pillow."""
        width, height = self.largest
        return {"device": "mixed", "hw_decoder_load": self.hw_decoder_load,
                "preallocate_width_hint": width, "preallocate_height_hint": height,
                **self.memory.decoder_options(), "affine": False,
                "jpeg_fancy_upsampling": True}

    def consumer_stream(self) -> torch.cuda.Stream | None:
        """On a GPU torch's current stream, on which DALI 2.4's `Pipeline.run(cuda_stream, /)`
        hands its outputs over: the stream, not the host, waits for DALI's work."""
        device = self.spec.form.device
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def to_batch(self, images, labels, rows, reasons, stream, size: int) -> DeviceBatch:
        """DALI's outputs copied into tensors torch owns (DALI reuses its buffers), queued on
        `stream`, the placeholders dropped (rows and reasons are on the host already)."""
        form, count = self.spec.form, len(rows)
        shape = (count, size, size, 3) if self.layout() == "HWC" else (count, 3, size, size)
        pixels = torch.empty(shape, dtype=torch.float32, device=form.device)
        targets = torch.empty(count, dtype=torch.int64, device=form.device)
        if count:
            feed_ndarray(images.as_tensor(), pixels, cuda_stream=stream)
            feed_ndarray(labels.as_tensor(), targets, cuda_stream=stream)
        why = [bytes(reasons.at(i)).decode("utf-8") for i in range(count)]
        skipped = [Skipped(self.spec.frame.path.iat[int(rows.at(i))], why[i])
                   for i in range(count) if why[i]]
        if skipped:  # contiguous runs of good images: slices and one cat, no device sync
            runs = _runs([i for i in range(count) if not why[i]]) or [(0, -1)]
            pixels = torch.cat([pixels[first:last + 1] for first, last in runs])
            targets = torch.cat([targets[first:last + 1] for first, last in runs])
        if self.layout() == "HWC":
            pixels = pixels.permute(0, 3, 1, 2)  # a view with channels_last strides
        return DeviceBatch(pixels.to(form.dtype), targets, skipped)

    def redo_with_pillow(self, epoch: int, step: int) -> DeviceBatch:
        spec = self.spec
        if self.fallback is None:
            self.fallback = ImageDataset(spec.root, spec.frame, spec.recipe, spec.batches)
        items = spec.batches.items(spec.batches.order(epoch), epoch, step)
        host = collate(self.fallback.__getitems__(BatchRequest(items, [], epoch)))
        images, labels = self.to_device(host.images, host.labels)
        return DeviceBatch(images, labels, host.skipped)

    def end_epoch(self, epoch: int) -> None:
        """DALI's source ends the epoch with StopIteration; reset for the next one."""
        if self.pipe is None or self.next is None:
            return
        try:
            self.pipe.run()
        except StopIteration:
            self.pipe.reset()
            self.next = (self.pass_of(epoch + 1), 0)
            return
        raise RuntimeError(f"the DALI pipeline delivered more than {self.steps_per_epoch()} "
                           f"steps in epoch {epoch + 1}")

    def close(self, at_once: bool = False) -> None:
        """Stops the reader processes (DALI's pool ends them at once) and frees DALI's memory."""
        self.pipe = None
        self.next = None


def what_failed(error: RuntimeError) -> str:
    """The line of DALI's message that says what went wrong, after its preamble."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = next((line for line in lines if line.startswith("Failed to decode")), None)
    return (detail or first_line(error))[:200]


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5, 6] -> [(0, 2), (5, 6)]"""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs

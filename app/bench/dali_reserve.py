"""What each DALI pipeline reserves when it is built (gpu-check's dali_memory part): the
formula's expectation (app/data/dali_memory.py) beside what the machine shows, as JSON. In a
process of its own, like every part, so that no other part's allocations count; built as a
training worker builds them (train, then val, both kept) on a generated sample.

- GPU: the drop in the device's free memory (so DALI's own pool counts) around each build, less
  what torch's allocator reserved meanwhile; the same around its first batch, when DALI
  allocates what it sizes from the data (so it depends on the sample's image sizes).
- Pinned host memory: DALI has no usage counter for it, so this process's VmRSS and VmPin are
  measured (pinned buffers are resident pages; reader processes are not counted).
On a CPU the same code runs with CPU operators (no GPU figures): the tests do so."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

import torch

from app.catalog import sample
from app.catalog.storage import DatasetRoot
from app.catalog.tables import load_tables
from app.data.augment import EvalRecipe, TrainRecipe
from app.data.dali_memory import decoder_memory
from app.data.decoders import build_pipeline, dali_imports
from app.data.pipeline import InputFormat, PipelineSpec
from app.data.sampler import ShardedBatches
from app.runtime.errors import first_line

SPLITS = ("train", "val")


def expected(threads: int, batch_size: int) -> dict:
    """Per split: the decoder's threads and paddings and what they reserve, in bytes."""
    memories = {split: decoder_memory(split, batch_size, threads) for split in SPLITS}
    return {split: {**dataclasses.asdict(memory), "gpu_bytes": memory.device_bytes,
                    "pinned_bytes": memory.pinned_bytes} for split, memory in memories.items()}


def host_memory() -> dict:
    """This process's resident and pinned memory in bytes ({} without /proc)."""
    fields, out = {"VmRSS:": "host_rss", "VmPin:": "host_pinned_vm"}, {}
    with contextlib.suppress(OSError), open("/proc/self/status") as handle:
        for name, *value in map(str.split, handle):
            if name in fields and value:
                out[fields[name]] = int(value[0]) * 1024  # kB
    return out


def snapshot(device: torch.device) -> dict:
    values = host_memory()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        values["gpu_free"] = torch.cuda.mem_get_info(device)[0]
        values["torch_reserved"] = torch.cuda.memory_reserved(device)
    return values


def difference(before: dict, after: dict) -> dict:
    """Bytes taken between two snapshots (GPU: not counting torch's own allocator)."""
    taken = {f"{key}_bytes": after[key] - before[key] for key in ("host_rss", "host_pinned_vm")
             if key in before and key in after}
    if "gpu_free" in before:
        taken["gpu_bytes"] = (before["gpu_free"] - after["gpu_free"]) - \
            (after["torch_reserved"] - before["torch_reserved"])
    return taken


def measure_pipeline(pipeline, device: torch.device) -> dict:
    """Taken by the pipeline's build (open), then by its first batch."""
    before = snapshot(device)
    pipeline.open(0)
    built = snapshot(device)
    images = len(next(iter(pipeline.epoch(0))))
    return {"build": difference(before, built), "first_batch": difference(built,
                                                                          snapshot(device)),
            "first_batch_images": images, "preallocation_hint": pipeline.largest}


def measure(threads: int, batch_size: int, device: torch.device, preset: str = "tiny") -> dict:
    """Both pipelines built one after the other, as a worker does, on the `preset` sample."""
    root = DatasetRoot(preset, str(sample.ensure(sample.default_cache_dir(), preset, 0)))
    tables = load_tables(root)
    form = InputFormat(device, torch.float32, channels_last=device.type == "cuda")
    specs = {"train": PipelineSpec(root, tables.train, TrainRecipe(224), ShardedBatches(
                 len(tables.train), batch_size, seed=0), threads, form),
             "val": PipelineSpec(root, tables.val, EvalRecipe(224), ShardedBatches(
                 len(tables.val), batch_size, shuffle=False), threads, form)}
    pipelines, out = [], {}
    try:
        for split in SPLITS:
            pipelines.append(build_pipeline("dali", specs[split]))
            out[split] = measure_pipeline(pipelines[-1], device)
    finally:
        for pipeline in pipelines:
            pipeline.close()
        from nvidia.dali import backend  # noqa: PLC0415
        backend.ReleaseUnusedMemory()  # DALI's pools keep what they took: given back
    return out


def run(threads: int, batch_size: int, on_gpu: bool, preset: str = "tiny") -> dict:
    """The expectation always, the measurement where there is a GPU and DALI imports (its
    error, if building fails, in the report rather than a traceback)."""
    report = {"threads": threads, "batch_size": batch_size, "sample": preset,
              "formula": "GPU: threads x device padding; pinned host: 2 x threads x host padding",
              "expected": expected(threads, batch_size), "measured": None, "why_not": None}
    if not on_gpu:
        report["why_not"] = "no CUDA GPU"
    elif not dali_imports():
        report["why_not"] = "NVIDIA DALI does not import"
    else:
        try:
            report["measured"] = measure(threads, batch_size, torch.device("cuda:0"), preset)
        except Exception as error:  # noqa: BLE001 (reported beside the expectation)
            report["why_not"] = f"building failed: {first_line(error)}"
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where the report goes")
    parser.add_argument("--threads", type=int, default=8, help="decoding threads (-j)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--sample", default="tiny", choices=("tiny", "bench"))
    args = parser.parse_args()
    report = run(args.threads, args.batch_size, torch.cuda.is_available(), args.sample)
    Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

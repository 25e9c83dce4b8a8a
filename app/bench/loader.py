"""Loader-only throughput: read + decode + augment, batches delivered on the device, no model.
Several datasets in one run (ratios to the first), an object-store dataset once per reader
(the baseline first), every dataset once per decoder, plain and with each auto-augment policy
(ratios to the plain row); the peer's loader (app/bench/peer_examples.py) on the first dataset
is the baseline of them all. The reader alone is measured too: GETs/s and client CPU per GET.
The CPU counted is this process's and every process's below it (loader workers, DALI's
readers), from /proc: how many cores a pipeline really costs, children that are still running
included (getrusage counts only those that ended)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Callable, Iterator

import torch

from app.bench.peer_examples import peer_batches
from app.catalog import Catalog
from app.catalog.storage import SHARD_LAYOUTS, DatasetRoot
from app.catalog.tables import load_tables
from app.data.augment import TrainRecipe
from app.data.decoders import build_pipeline
from app.data.pipeline import InputFormat, InputPipeline, PipelineSpec
from app.data.reader import BlobReader
from app.data.sampler import ShardedBatches
from app.data.windows import DEFAULT_WINDOW, batches_for
from app.runtime.liveness import descendants

DEFAULT_READERS = ("s3fs", "obstore")  # the baseline first
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def throughput(step: Callable[[], int], steps: int, device) -> dict:
    """Images/s of `steps` calls of `step` (each returns the images it handled), and the cores
    the process tree used meanwhile; the device's queue is waited for at both ends."""
    wait = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    wait()
    cpu, started = cpu_seconds(), time.perf_counter()
    images = sum(step() for _ in range(steps))
    wait()
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds,
            "cpu_cores": cpu / seconds, "cpu_ms_per_image": 1000 * cpu / images}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads, to the microsecond) and of
    every process below it (to the clock tick: 10 ms)."""
    return time.process_time() + sum(map(process_cpu_seconds, descendants(os.getpid())))


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (after the name)
    except (OSError, IndexError, ValueError):  # gone meanwhile, or no /proc
        return 0.0


def batches_forever(pipeline: InputPipeline):
    epoch = 0
    while True:
        yield from pipeline.epoch(epoch)
        epoch += 1


def measure(root: DatasetRoot, image_size: int, batch_size: int, workers: int, batches: int,
            decoder: str, device: torch.device, auto_augment: str = "off") -> dict:
    frame = load_tables(root).train
    recipe = TrainRecipe(image_size, auto_augment=auto_augment)
    started = time.perf_counter()
    pipeline = build_pipeline(decoder, PipelineSpec(
        root, frame, recipe, batches_for(frame, batch_size, root.options.get(
            "window", DEFAULT_WINDOW), seed=0), workers, InputFormat(device)))
    try:
        sizes = (len(b) + len(b.skipped) for b in batches_forever(pipeline))
        result = timed(sizes, batches, device, started)
    finally:
        pipeline.close()  # stop the loader processes before the next dataset starts its own
    return {"dataset": root.name, "reader": root.reader, "decoder": decoder,
            "auto_augment": auto_augment, "url": root.url, **result,
            **reader_cost(root, frame, batch_size, batches)}


def measure_peer(root: DatasetRoot, image_size: int, batch_size: int, workers: int,
                 batches: int, device: torch.device) -> dict:
    frame = load_tables(root).train
    sizes = (len(labels) for _, labels in peer_batches(root, frame, image_size, batch_size,
                                                        workers, device))
    return {"dataset": root.name, "decoder": "pytorch/examples", "url": root.url,
            **timed(sizes, batches, device)}


def timed(sizes: Iterator[int], batches: int, device: torch.device,
          started: float | None = None) -> dict:
    """Images/s and CPU of `batches` batches, after one for start-up (processes, connections
    and DALI's pipeline are not throughput); `sizes` yields each batch's images, the skipped
    counted. `started`: when the pipeline was asked for, for the first batch's latency."""
    started = time.perf_counter() if started is None else started
    next(sizes)
    first_batch_s = time.perf_counter() - started
    return {**throughput(lambda: next(sizes), batches, device), "first_batch_s": first_batch_s}


def reader_cost(root: DatasetRoot, frame, batch_size: int, batches: int) -> dict:
    """GETs/s and client CPU per GET of the reader alone, in this process: `batches` batches,
    each announcing the next as the pipeline does; without the local cache, so every image is
    a request, and in another epoch's order, so none was read before. Shards make no request
    per image: their requests are counted at the server instead (tests/s3_bench.py)."""
    if root.layout in SHARD_LAYOUTS:
        return {"gets": 0, "gets_per_s": float("nan"), "cpu_ms_per_get": float("nan")}
    uncached = dataclasses.replace(root, options={k: v for k, v in root.options.items()
                                                  if k not in ("cache_dir", "cache_max_gb")})
    reader = BlobReader(uncached)
    order = ShardedBatches(len(frame), batch_size, seed=1)
    warmup, *paths = [[frame.path[i] for i, _ in batch]
                      for batch in itertools.islice(order, batches + 1)]
    reader.read_many(warmup)  # connections and threads start here
    pairs = zip(paths, paths[1:] + [[]])
    gets = throughput(lambda: len(reader.read_many(*next(pairs))), len(paths),
                      torch.device("cpu"))
    return {"gets": gets["images"], "gets_per_s": gets["images_per_s"],
            "cpu_ms_per_get": gets["cpu_ms_per_image"]}


def roots_to_measure(catalog: Catalog, names: list[str], readers: tuple[str, ...]
                     ) -> list[DatasetRoot]:
    """Each dataset once; an object-store dataset once per reader."""
    roots = []
    for name in names:
        root = catalog.open(name)
        if root.reader == "fsspec":
            roots.append(root)
            continue
        usable = [r for r in readers if r == "obstore" or root.url.startswith(("s3://", "s3a://"))]
        roots += [dataclasses.replace(root, options={**root.options, "reader": reader})
                  for reader in usable]
    return roots


def run(catalog_path: str, datasets: list[str], image_size: int, batch_size: int, workers: int,
        batches: int, readers: tuple[str, ...] = DEFAULT_READERS,
        decoders: tuple[str, ...] = ("pillow",), device: str = "cpu", peer: bool = True,
        auto_augment: tuple[str, ...] = ()) -> dict:
    catalog = Catalog.load(catalog_path)
    where = torch.device(device)
    roots = roots_to_measure(catalog, datasets, readers)
    augments = ("off", *(name for name in auto_augment if name != "off"))
    results = [measure(root, image_size, batch_size, workers, batches, decoder, where, augment)
               for root in roots for decoder in decoders for augment in augments]
    baseline = measure_peer(roots[0], image_size, batch_size, workers, batches, where) \
        if peer else None
    for result in results:
        result["ratio_to_first"] = result["images_per_s"] / results[0]["images_per_s"]
        if baseline:
            result["ratio_to_peer"] = result["images_per_s"] / baseline["images_per_s"]
        plain = next(r for r in results if same_pipeline(r, result))
        result["ratio_to_plain"] = result["images_per_s"] / plain["images_per_s"]
        first = next((r for r in results if r["dataset"] == result["dataset"]), result)
        result["cpu_per_get_vs_baseline"] = (result["cpu_ms_per_get"] / first["cpu_ms_per_get"]
                                             if first["cpu_ms_per_get"] else float("nan"))
    return {"image_size": image_size, "batch_size": batch_size, "workers": workers,
            "batches": batches, "device": device, "cpu_count": os.cpu_count(),
            "peer": baseline, "results": results, "date": time.strftime("%Y-%m-%d")}


def same_pipeline(plain: dict, result: dict) -> bool:
    """`plain` is `result`'s row without auto-augment."""
    keys = ("dataset", "reader", "decoder")
    return plain["auto_augment"] == "off" and all(plain[k] == result[k] for k in keys)

"""Loader-only throughput: read + decode + augment, no model. Several datasets (e.g. the local
copy and the S3 copy of the same data) in one run, as ratios to the first one; an object-store
dataset is measured once per reader (today's s3fs path first, as the baseline), side by side.

Per row: images/s through the input pipeline and the CPU it spent per image (all its
processes), and, for the reader alone (no decoding), GETs/s and client CPU per GET: the
figure that says how many cores a given image rate costs.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import resource
import time

import torch

from app.catalog import Catalog
from app.data.augment import TrainRecipe
from app.data.decoders import build_pipeline
from app.data.pipeline import InputFormat, InputPipeline, PipelineSpec
from app.data.reader import BlobReader
from app.data.sampler import ShardedBatches
from app.storage import DatasetRoot
from app.tables import load_tables

DEFAULT_READERS = ("s3fs", "obstore")  # the baseline first


def batches_forever(pipeline: InputPipeline):
    epoch = 0
    while True:
        yield from pipeline.epoch(epoch)
        epoch += 1


def cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its live child processes (the loader
    processes), from /proc where there is one."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    ticks = os.sysconf("SC_CLK_TCK")
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        except (OSError, IndexError, ValueError):
            return float("nan")
    return total


def measure(root: DatasetRoot, image_size: int, batch_size: int, workers: int, batches: int,
            decoder: str = "pillow") -> dict:
    frame = load_tables(root).train
    pipeline = build_pipeline(decoder, PipelineSpec(
        root, frame, TrainRecipe(image_size), ShardedBatches(len(frame), batch_size, seed=0),
        workers, InputFormat(torch.device("cpu"))))
    stream = batches_forever(pipeline)
    next(stream)  # start-up (processes, connections) is not throughput
    images = skipped = 0
    cpu, started = cpu_seconds(), time.perf_counter()
    for _ in range(batches):
        batch = next(stream)
        images += len(batch)
        skipped += len(batch.skipped)
    elapsed, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    stream.close()
    pipeline.close()  # stop the loader processes before the next dataset starts its own
    read = images + skipped
    return {"dataset": root.name, "reader": root.reader, "url": root.url, "images": read,
            "skipped": skipped, "seconds": elapsed, "images_per_s": read / elapsed,
            "cpu_ms_per_image": 1000 * cpu / read, **reader_cost(root, frame, batch_size,
                                                                  batches)}


def reader_cost(root: DatasetRoot, frame, batch_size: int, batches: int) -> dict:
    """GETs/s and client CPU per GET of the reader alone, in this process: `batches` batches,
    each announcing the next as the pipeline does; without the local cache, so every image is
    a request, and in another epoch's order, so none was read before."""
    uncached = dataclasses.replace(root, options={k: v for k, v in root.options.items()
                                                  if k not in ("cache_dir", "cache_max_gb")})
    reader = BlobReader(uncached)
    order = ShardedBatches(len(frame), batch_size, seed=1)
    warmup, *paths = [[frame.path[i] for i, _ in batch]
                      for batch in itertools.islice(order, batches + 1)]
    reader.read_many(warmup)  # connections and threads start here
    cpu, started = cpu_seconds(), time.perf_counter()
    count = 0
    for current, upcoming in zip(paths, paths[1:] + [[]]):
        count += len(reader.read_many(current, upcoming))
    elapsed, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {"gets": count, "gets_per_s": count / elapsed, "cpu_ms_per_get": 1000 * cpu / count}


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
        batches: int, readers: tuple[str, ...] = DEFAULT_READERS) -> dict:
    catalog = Catalog.load(catalog_path)
    results = [measure(root, image_size, batch_size, workers, batches)
               for root in roots_to_measure(catalog, datasets, readers)]
    for result in results:
        result["ratio_to_first"] = result["images_per_s"] / results[0]["images_per_s"]
        baseline = next((r for r in results if r["dataset"] == result["dataset"]), result)
        result["cpu_per_get_vs_baseline"] = result["cpu_ms_per_get"] / baseline["cpu_ms_per_get"]
    return {"image_size": image_size, "batch_size": batch_size, "workers": workers,
            "batches": batches, "cpu_count": os.cpu_count(), "results": results,
            "date": time.strftime("%Y-%m-%d")}


def format_report(report: dict) -> str:
    lines = [f"loader only (read + decode + augment), batch {report['batch_size']}, "
             f"{report['workers']} loader processes, {report['image_size']} px, "
             f"{report['batches']} batches; reader alone: client CPU per GET, no cache",
             f"{'dataset':<20}{'reader':<9}{'images/s':>10}{'vs first':>9}{'CPU ms/img':>11}"
             f"{'GETs/s':>9}{'CPU ms/GET':>11}{'vs base':>8}  url"]
    for r in report["results"]:
        lines.append(f"{r['dataset']:<20}{r['reader']:<9}{r['images_per_s']:>10.1f}"
                     f"{r['ratio_to_first']:>9.2f}{r['cpu_ms_per_image']:>11.2f}"
                     f"{r['gets_per_s']:>9.1f}{r['cpu_ms_per_get']:>11.2f}"
                     f"{r['cpu_per_get_vs_baseline']:>8.2f}  {r['url']}")
    return "\n".join(lines)

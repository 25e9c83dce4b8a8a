"""Loader-only throughput: read + decode + augment, no model. Several datasets (e.g. the local
copy and the S3 copy of the same data) in one run, as ratios to the first one."""

from __future__ import annotations

import time

import torch

from app.catalog import Catalog
from app.data.augment import TrainRecipe
from app.data.decoders import build_pipeline
from app.data.pipeline import InputFormat, InputPipeline, PipelineSpec
from app.data.sampler import ShardedBatches
from app.storage import DatasetRoot
from app.tables import load_tables


def batches_forever(pipeline: InputPipeline):
    epoch = 0
    while True:
        yield from pipeline.epoch(epoch)
        epoch += 1


def measure(root: DatasetRoot, image_size: int, batch_size: int, workers: int, batches: int,
            decoder: str = "pillow") -> dict:
    frame = load_tables(root).train
    pipeline = build_pipeline(decoder, PipelineSpec(
        root, frame, TrainRecipe(image_size), ShardedBatches(len(frame), batch_size, seed=0),
        workers, InputFormat(torch.device("cpu"))))
    stream = batches_forever(pipeline)
    next(stream)  # start-up (processes, connections) is not throughput
    images = skipped = 0
    started = time.perf_counter()
    for _ in range(batches):
        batch = next(stream)
        images += len(batch)
        skipped += len(batch.skipped)
    elapsed = time.perf_counter() - started
    stream.close()
    pipeline.close()  # stop the loader processes before the next dataset starts its own
    return {"dataset": root.name, "url": root.url, "images": images + skipped,
            "skipped": skipped, "seconds": elapsed, "images_per_s": (images + skipped) / elapsed}


def run(catalog_path: str, datasets: list[str], image_size: int, batch_size: int, workers: int,
        batches: int) -> dict:
    catalog = Catalog.load(catalog_path)
    results = [measure(catalog.open(name), image_size, batch_size, workers, batches)
               for name in datasets]
    for result in results:
        result["ratio_to_first"] = result["images_per_s"] / results[0]["images_per_s"]
    return {"image_size": image_size, "batch_size": batch_size, "workers": workers,
            "batches": batches, "results": results, "date": time.strftime("%Y-%m-%d")}


def format_report(report: dict) -> str:
    lines = [f"loader only (read + decode + augment), batch {report['batch_size']}, "
             f"{report['workers']} loader processes, {report['image_size']} px, "
             f"{report['batches']} batches",
             f"{'dataset':<20}{'images/s':>12}{'vs first':>10}  url"]
    for r in report["results"]:
        lines.append(f"{r['dataset']:<20}{r['images_per_s']:>12.1f}{r['ratio_to_first']:>10.2f}"
                     f"  {r['url']}")
    return "\n".join(lines)

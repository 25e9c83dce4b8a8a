"""The input pipeline from JPEG files. `loader`: the pipeline alone (read + decode + augment,
batches on the device, no model) per dataset (ratios to the first), per reader of an object
store (the baseline first), per decoder, plain and with each auto-augment policy (ratios to
the plain row), beside the peer's loader (app/bench/peer_examples.py) on the first dataset;
and the reader alone: GETs/s and client CPU per GET. `e2e`: training from them, ours per
decoder beside the peer's recipe and as a share of our model-only speed with the same settings
(the gap is what the input pipeline still costs). The CPU counted is the whole process tree's
(model.timed): how many cores a pipeline really costs."""

from __future__ import annotations

import dataclasses
import itertools
import os
import tempfile
import time
from typing import Callable

import torch

from app.bench.model import OURS_EAGER, OURS_REGIONS, measure as model_alone, timed
from app.bench.peer_examples import peer_batches
from app.catalog import Catalog
from app.catalog.storage import SHARD_LAYOUTS, DatasetRoot
from app.catalog.tables import load_tables
from app.config.sources import parse_config
from app.data.augment import TrainRecipe
from app.data.decoders import build_pipeline, dali_imports
from app.data.pipeline import InputFormat, InputPipeline, PipelineSpec
from app.data.reader import BlobReader
from app.data.sampler import ShardedBatches
from app.data.windows import DEFAULT_WINDOW, batches_for
from app.launch.run import prepare_job, write_run_folder
from app.models.factory import create_model
from app.parallel.sync import LocalSync
from app.runtime.devices import WorkerEnv
from app.training.speed import compile_enabled
from app.training.trainer import Trainer


def batches_forever(pipeline: InputPipeline):
    return itertools.chain.from_iterable(map(pipeline.epoch, itertools.count()))


def measure(root: DatasetRoot, image_size: int, batch_size: int, workers: int, batches: int,
            decoder: str, device: torch.device, auto_augment: str = "off") -> dict:
    frame = load_tables(root).train
    recipe = TrainRecipe(image_size, auto_augment=auto_augment)
    started = time.perf_counter()
    pipeline = build_pipeline(decoder, PipelineSpec(
        root, frame, recipe, batches_for(frame, batch_size, root.options.get(
            "window", DEFAULT_WINDOW), seed=0), workers, InputFormat(device)))
    # one batch for start-up (processes, connections, DALI's pipeline: not throughput), its
    # latency from the build; the skipped images counted
    try:
        sizes = (len(b) + len(b.skipped) for b in batches_forever(pipeline))
        result = timed(lambda: next(sizes), batches, 1, device, started)
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
            **timed(lambda: next(sizes), batches, 1, device)}


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
    paths = [[frame.path[i] for i, _ in batch] for batch in itertools.islice(order, batches + 1)]
    pairs = zip(paths, paths[1:] + [[]])  # the first batch starts connections and threads
    gets = timed(lambda: len(reader.read_many(*next(pairs))), batches, 1, torch.device("cpu"))
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


def run_loader(catalog_path: str, datasets: list[str], image_size: int, batch_size: int,
               workers: int, batches: int, readers: tuple[str, ...] = ("s3fs", "obstore"),
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
        plain = next(r for r in results if r["auto_augment"] == "off" and all(
            r[key] == result[key] for key in ("dataset", "reader", "decoder")))
        result["ratio_to_plain"] = result["images_per_s"] / plain["images_per_s"]
        first = next((r for r in results if r["dataset"] == result["dataset"]), result)
        result["cpu_per_get_vs_baseline"] = (result["cpu_ms_per_get"] / first["cpu_ms_per_get"]
                                             if first["cpu_ms_per_get"] else float("nan"))
    return {"image_size": image_size, "batch_size": batch_size, "workers": workers,
            "batches": batches, "device": device, "cpu_count": os.cpu_count(),
            "peer": baseline, "results": results, "date": time.strftime("%Y-%m-%d")}


# e2e: training from the files
@dataclasses.dataclass(frozen=True)
class E2ESetup:
    catalog: str
    dataset: str
    arch: str
    batch_size: int
    image_size: int
    workers: int  # loader processes (ours: DALI's readers and threads; the peer's DataLoader)
    device: str
    steps: int
    warmup: int
    decoders: tuple[str, ...] = ("auto",)
    compile: str = "auto"


def train_ours(setup: E2ESetup, decoder: str) -> dict:
    if decoder == "dali" and not dali_imports():
        return {"label": "ours (dali)", "skipped": "NVIDIA DALI does not import here"}
    with tempfile.TemporaryDirectory() as folder:
        config, _ = parse_config([
            "--catalog", setup.catalog, "--dataset", setup.dataset, "-a", setup.arch,
            "-b", str(setup.batch_size), "--image-size", str(setup.image_size),
            "-j", str(setup.workers), "--device", setup.device, "--decoder", decoder,
            "--compile", setup.compile, "--output-dir", folder, "--run-name", "bench"])
        job = prepare_job(config)
        write_run_folder(job)
        trainer = Trainer(job, WorkerEnv(device=setup.device), LocalSync())
        batches = batches_forever(trainer.train_data)

        def step() -> int:
            batch = next(batches)
            trainer.train_step(batch)
            return len(batch)
        try:
            name = type(trainer.train_data).__name__.removesuffix("Pipeline").lower()
            compiled = " compiled" if compile_enabled(setup.compile, torch.device(setup.device)) \
                else ""
            return {"label": f"ours ({name}{compiled})",
                    **timed(step, setup.steps, setup.warmup, torch.device(setup.device))}
        finally:
            trainer.close()
            del trainer, batches  # the next decoder's run starts with this one's memory free
            release()


def release() -> None:
    """What a measurement compiled and allocated let go: the next one compiles its own
    modules (from the caches on disk) and starts with the GPU's memory free."""
    torch.compiler.reset()
    torch.cuda.empty_cache()  # nothing without CUDA


def train_peer(setup: E2ESetup) -> dict:
    """pytorch/examples' loop: fp32, NCHW, eager; TF32 only where torch allows it by default
    (convolutions), cuDNN autotuning on."""
    device = torch.device(setup.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("highest")
    root = Catalog.load(setup.catalog).open(setup.dataset)
    tables = load_tables(root)
    torch.manual_seed(0)
    model = create_model(setup.arch, tables.num_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    batches = peer_batches(root, tables.train, setup.image_size, setup.batch_size,
                           setup.workers, device)

    def step() -> int:
        images, labels = next(batches)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return len(labels)
    return {"label": "pytorch/examples recipe", **timed(step, setup.steps, setup.warmup, device)}


def run_e2e(setup: E2ESetup, progress: Callable[[dict], None] = lambda report: None) -> dict:
    """The peer, the model alone, then each decoder; `progress` gets the report after each."""
    compiled = compile_enabled(setup.compile, torch.device(setup.device))
    report = {"what": "end to end", "setup": dataclasses.asdict(setup),
              "results": [train_peer(setup)], "model_only": None, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d")}
    progress(report)
    # compiled by regions, as the trainer compiles: the same graphs, the same settings
    report["model_only"] = model_alone(
        setup.arch, OURS_REGIONS if compiled else OURS_EAGER,
        setup.batch_size, setup.image_size, setup.device, setup.steps, setup.warmup)
    release()
    compare(report)
    progress(report)
    for decoder in setup.decoders:
        report["results"].append(train_ours(setup, decoder))
        compare(report)
        progress(report)
    return report


def compare(report: dict) -> None:
    """Each row's speed against the peer's and the model alone's."""
    results, model_only = report["results"], report["model_only"]
    for result in results:
        if "skipped" not in result:
            result["ratio_to_peer"] = result["images_per_s"] / results[0]["images_per_s"]
            result["share_of_model_only"] = result["images_per_s"] / model_only["images_per_s"]

"""End to end: training from JPEG files, our trainer beside the peer's recipe
(app/bench/peer_examples.py) in the same run, and as a share of our model-only speed with the
same settings: the gap is what the input pipeline still costs. Each decoder is measured in turn,
beside one measurement of the peer and of the model alone."""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from app.bench import model as model_bench
from app.bench.loader import batches_forever, throughput
from app.bench.peer_examples import peer_batches
from app.catalog import Catalog
from app.catalog.tables import load_tables
from app.data.decoders import dali_imports
from app.config.sources import parse_config
from app.launch.run import prepare_job, write_run_folder
from app.models.factory import create_model
from app.parallel.sync import LocalSync
from app.runtime.devices import WorkerEnv
from app.training.speed import compile_enabled
from app.training.trainer import Trainer


@dataclass(frozen=True)
class Setup:
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


def timed(step: Callable[[], int], setup: Setup, label: str) -> dict:
    """Images/s of `step` (it returns the images it trained on) over setup.steps steps after
    setup.warmup, with the CPU cores the whole process tree used and the peak GPU memory."""
    device = torch.device(setup.device)
    for _ in range(setup.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return {"label": label, **throughput(step, setup.steps, device), "peak_memory_gb":
            torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def ours(setup: Setup, decoder: str) -> dict:
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
            return timed(step, setup, f"ours ({name}{compiled})")
        finally:
            trainer.close()
            del trainer, batches  # the next decoder's run starts with this one's memory free
            release()


def release() -> None:
    """What a measurement compiled and allocated let go: the next one compiles its own
    modules (from the caches on disk) and starts with the GPU's memory free."""
    torch.compiler.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peer(setup: Setup) -> dict:
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
    return timed(step, setup, "pytorch/examples recipe")


def run(setup: Setup, progress: Callable[[dict], None] = lambda report: None) -> dict:
    """The peer, the model alone, then each decoder; `progress` gets the report after each."""
    compiled = compile_enabled(setup.compile, torch.device(setup.device))
    report = {"what": "end to end", "setup": asdict(setup), "results": [peer(setup)],
              "model_only": None, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    progress(report)
    # compiled by regions, as the trainer compiles: the same graphs, the same settings
    report["model_only"] = model_bench.measure(
        setup.arch, model_bench.OURS_REGIONS if compiled else model_bench.OURS_EAGER,
        setup.batch_size, setup.image_size, setup.device, setup.steps, setup.warmup)
    release()
    compare(report)
    progress(report)
    for decoder in setup.decoders:
        report["results"].append(ours(setup, decoder))
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

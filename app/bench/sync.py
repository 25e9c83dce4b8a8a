"""Step time of the gradient sync modes on the same model and per-worker batch, in one run:
1 worker (no sync), N workers with the parameter server, N workers with all-reduce, on
synthetic inputs (only compute and gradient traffic count). Each mode runs in a process of its
own, so one mode's GPU memory (the caching allocator keeps it) is gone before the next
starts."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from app.bench.model import compiled, synthetic_batch
from app.config import ParallelConfig
from app.models.factory import create_model
from app.parallel.launcher import launch
from app.runtime.devices import WorkerEnv, use_device
from app.training.precision import Precision


@dataclass(frozen=True)
class SyncBenchJob:
    arch: str
    batch_size: int
    image_size: int
    steps: int
    warmup: int
    result_file: str
    compile: str = "off"  # off | whole | regions (app/bench/model.py compiled())
    compile_backend: str = "inductor"


def bench_process(job: SyncBenchJob, env: WorkerEnv, plan, cpu_workers: int) -> None:
    use_device(env.device, cpu_workers)
    sync = plan.connect(env)
    precision = Precision.from_config("auto", True, env.device)
    torch.manual_seed(0)
    model = sync.prepare(precision.prepare_model(create_model(job.arch, 1000)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model = compiled(model, job.compile, job.batch_size, job.compile_backend)  # after prepare
    images, labels = synthetic_batch(precision, job.batch_size, job.image_size)
    times = []
    for _ in range(job.warmup + job.steps):
        started = time.perf_counter()
        with sync.step(job.batch_size) as loss_scale:
            with precision.autocast():
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            (loss * loss_scale).backward()
        if sync.finish_step():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if env.device.startswith("cuda"):
            torch.cuda.synchronize(env.device)
        times.append(time.perf_counter() - started)
    if env.is_primary:
        Path(job.result_file).write_text(json.dumps(times[job.warmup:]))
    sync.close()


def run_mode(job: SyncBenchJob, devices: list[str], mode: str, parallel: ParallelConfig) -> None:
    """One mode, in a spawned process of its own (the single worker of `local` runs in it)."""
    sys.exit(launch(bench_process, job, devices, mode, parallel))


MODES = ("local", "ps", "allreduce")


def run(arch: str, batch_size: int, image_size: int, devices: list[str], steps: int,
        warmup: int, bucket_mb: float, compile: str = "off", compile_backend: str = "inductor",
        modes: tuple[str, ...] = MODES,
        progress: Callable[[dict], None] = lambda report: None) -> dict:
    """The modes one after the other (`local`: 1 worker, no sync); `progress` gets the report
    after each."""
    modes = [(label, mode, mode_devices) for label, mode, mode_devices in (
        ("1 worker", "local", devices[:1]), (f"{len(devices)} workers, ps", "ps", devices),
        (f"{len(devices)} workers, allreduce", "allreduce", devices)) if mode in modes]
    parallel = ParallelConfig(bucket_mb=bucket_mb, check_every=10**9)
    params = sum(p.numel() for p in create_model(arch, 1000).parameters())
    results: list[dict] = []
    report = {"arch": arch, "parameters": params, "gradient_mb": params * 4 / 2**20,
              "batch_per_worker": batch_size, "image_size": image_size, "devices": devices,
              "bucket_mb": bucket_mb, "steps": steps, "warmup": warmup, "compile": compile,
              "compile_backend": compile_backend, "ps_over_allreduce": None,
              "results": results, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as folder:
        for label, mode, mode_devices in modes:
            job = SyncBenchJob(arch, batch_size, image_size, steps, warmup,
                               str(Path(folder) / f"{mode}.json"), compile, compile_backend)
            process = torch.multiprocessing.get_context("spawn").Process(
                target=run_mode, args=(job, mode_devices, mode, parallel))
            process.start()
            process.join()
            if process.exitcode != 0:
                raise RuntimeError(f"benchmark run '{label}' failed (exit {process.exitcode})")
            times = json.loads(Path(job.result_file).read_text())
            step = statistics.median(times)
            results.append({"label": label, "mode": mode, "workers": len(mode_devices),
                            "step_time_s": step, "step_times_s": times,
                            "images_per_s": batch_size * len(mode_devices) / step})
            by_mode = {r["mode"]: r["step_time_s"] for r in results}
            if {"ps", "allreduce"} <= set(by_mode):
                report["ps_over_allreduce"] = by_mode["ps"] / by_mode["allreduce"]
            progress(report)
    return report

"""The training step on a synthetic batch already on the device (forward + backward + SGD
step): no input pipeline counts. `model`: our settings beside the peer's numerics
(pytorch/examples: fp32 NCHW, eager) in the same run; batch augmentations, a recipe's
optimizer, clipping, the EMA update and a set of image sizes each beside the plain step.
`sync`: on N workers per gradient sync mode. `timed`: every bench's timing loop."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from app.config import AugmentConfig, OptimConfig, ParallelConfig
from app.data.batch_augment import BatchAugment
from app.models.factory import create_model
from app.parallel.launcher import launch
from app.runtime.devices import WorkerEnv, use_device
from app.runtime.liveness import descendants
from app.training.ema import ModelEma
from app.training.optim import build_optimizer, clip_gradients
from app.training.precision import Precision
from app.training.speed import CompiledForFullBatches, configure_backends

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ModelSetting:
    label: str
    amp: str  # auto | bf16 | fp16 | off
    channels_last: bool
    compile: str  # off | whole | regions: compiled()
    backend: str = "inductor"  # torch.compile's


OURS = ModelSetting("ours: bf16, channels_last, compiled", "auto", True, "whole")
OURS_EAGER = ModelSetting("ours without compile", "auto", True, "off")
# compiled as training compiles: each block of the stages (app/training/speed.py)
OURS_REGIONS = ModelSetting("ours: bf16, channels_last, compiled by regions", "auto", True,
                            "regions")
PEER = ModelSetting("pytorch/examples: fp32, NCHW", "off", False, "off")


def compiled(model: torch.nn.Module, setting: str, batch_size: int, backend: str
             ) -> torch.nn.Module:
    """The module that runs `model` under `setting` (model may be wrapped by DDP)."""
    if setting == "whole":  # one graph of the whole model
        return torch.compile(model, backend=backend, dynamic=False)
    if setting == "regions":
        return CompiledForFullBatches(model, batch_size, backend)
    return model


def synthetic_batch(precision: Precision, batch_size: int, image_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images, in the memory format of `precision`, and labels of 1,000 classes."""
    images = torch.randn(batch_size, 3, image_size, image_size, device=precision.device)
    if precision.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, 1000, (batch_size,), device=precision.device)


def measure(arch: str, setting: ModelSetting, batch_size: int, image_size: int, device: str,
            steps: int, warmup: int, augment: BatchAugment | None = None,
            optim: OptimConfig | None = None, ema_every: int = 0) -> dict:
    """Images/s over `steps` timed steps after `warmup` (the first includes compilation);
    `augment` augments each batch first, as the Trainer does; `ema_every`: the weights' moving
    average updated every that many steps."""
    precision = Precision.from_config(setting.amp, setting.channels_last, device)
    configure_backends(precision.device, cudnn_benchmark=True, tf32=True)
    torch.manual_seed(0)
    model = precision.prepare_model(create_model(arch, 1000))
    # a fresh cache, static shapes: each size gets its own graph, as in training, not the
    # dynamic-shape graph a second size would turn the cached one into
    torch.compiler.reset()
    forward = compiled(model, setting.compile, batch_size, setting.backend)
    # plain SGD unless a recipe's optimizer (and clipping) is asked for, built as training does
    optimizer = build_optimizer(model, optim, batch_size) if optim else \
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, labels = synthetic_batch(precision, batch_size, image_size)
    ema = ModelEma(model, decay=0.999, every=ema_every) if ema_every else None
    counter = itertools.count()

    def step() -> int:  # on the same tensors every step: the values drift, the work does not
        index = next(counter)
        inputs, targets = augment(images, labels, index) if augment else (images, labels)
        with precision.autocast():
            loss = torch.nn.functional.cross_entropy(forward(inputs), targets)
        loss.backward()
        if optim:
            clip_gradients(optimizer, optim.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ema:
            ema.after_step(index, index + 1)
        return batch_size

    result = timed(step, steps, warmup, precision.device)
    label = setting.label + (" + batch augment" if augment else "") + (
        f" + {optim.optimizer}" + (f", clip {optim.clip_grad_norm:g}" if optim.clip_grad_norm
                                   else "") if optim else "") + (
        f" + EMA every {ema_every}" if ema_every else "")
    return {**asdict(setting), "label": label, "arch": arch, "batch_size": batch_size,
            "image_size": image_size, "device": str(precision.device), **result,
            "step_ms": 1000 * result["seconds"] / steps}


def timed(step: Callable[[], int], steps: int, warmup: int, device: torch.device,
          started: float | None = None) -> dict:
    """Images/s of `steps` calls of `step` (each returns the images it handled) after `warmup`
    (at least one), with the cores the process tree used and the GPU's peak memory meanwhile;
    first_step_s: the first call's seconds (compilation, a pipeline's start-up), from
    `started` where given. The device's queue is waited for at each end."""
    wait = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    started = time.perf_counter() if started is None else started
    step()
    wait()
    first_step_s = time.perf_counter() - started
    for _ in range(warmup - 1):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    wait()
    cpu, started = cpu_seconds(), time.perf_counter()
    images = sum(step() for _ in range(steps))
    wait()
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds,
            "cpu_cores": cpu / seconds, "cpu_ms_per_image": 1000 * cpu / images,
            "first_step_s": first_step_s, "peak_memory_gb": torch.cuda.max_memory_allocated(
                device) / 2**30 if device.type == "cuda" else None}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads, to the microsecond) and of
    every process below it (loader workers, DALI's readers; to the clock tick: 10 ms), read
    from /proc: getrusage counts only children that ended."""
    return time.process_time() + sum(map(process_cpu_seconds, descendants(os.getpid())))


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (after the name)
    except (OSError, IndexError, ValueError):  # gone meanwhile, or no /proc
        return 0.0


def augment_alone_ms(augment: BatchAugment, batch_size: int, image_size: int, device: str,
                     steps: int) -> float:
    """Milliseconds per batch of the augmentations by themselves (host draws included)."""
    device, counter = torch.device(device), itertools.count()
    images = torch.randn(batch_size, 3, image_size, image_size, device=device)
    labels = torch.randint(0, augment.num_classes, (batch_size,), device=device)
    return 1000 * timed(lambda: len(augment(images, labels, next(counter))[0]), steps, 1,
                        device)["seconds"] / steps


def compared(rows: list[dict], largest: int) -> list[dict]:
    """The sizes' rows, each against the largest size (None while its row is to come) beside
    the pixel ratio: what progressive resizing can buy."""
    other = next((r["images_per_s"] for r in rows if r["image_size"] == largest), None)
    return [{**r, "speed_vs_largest": r["images_per_s"] / other if other else None,
             "pixels_vs_largest": (largest / r["image_size"]) ** 2} for r in rows]


def run(arch: str, batch_size: int, image_size: int, device: str, steps: int, warmup: int,
        settings: list[ModelSetting], augment: AugmentConfig | None = None,
        sizes: list[int] | None = None, optimizers: list[OptimConfig] | None = None,
        ema_every: int = 0, progress: Callable[[dict], None] = lambda report: None) -> dict:
    """`progress` gets the report after each row, and once it is whole."""
    results: list[dict] = []
    report = {"what": "model only", "results": results, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d")}
    for setting in settings:
        results.append(measure(arch, setting, batch_size, image_size, device, steps, warmup))
        progress(report)
    if augment:
        batch_augment = BatchAugment.from_config(augment, 1000, seed=0, rank=0)
        ours = [s for s in settings if s != PEER]
        results[len(ours):len(ours)] = [measure(arch, s, batch_size, image_size, device,
                                                steps, warmup, batch_augment) for s in ours]
        alone = augment_alone_ms(batch_augment, batch_size, image_size, device, steps)
        report["batch_augment"] = {**asdict(augment), "ms_per_step": alone,
                                   "share_of_plain_step": alone / results[0]["step_ms"]}
    if optimizers:  # the step with each recipe's optimizer (and clipping) beside plain SGD
        rows = [measure(arch, settings[0], batch_size, image_size, device, steps, warmup,
                        optim=optim) for optim in optimizers]
        report["optimizers"] = [{**row, "step_vs_plain": row["step_ms"] / results[0]["step_ms"]}
                                for row in rows]
    if ema_every:  # the step followed by the EMA's update every `ema_every` steps
        row = measure(arch, settings[0], batch_size, image_size, device, steps, warmup,
                      ema_every=ema_every)
        report["ema"] = {**row, "step_vs_plain": row["step_ms"] / results[0]["step_ms"]}
    by_size: list[dict] = []
    for size in sizes or []:  # our first setting at each size
        by_size.append(measure(arch, settings[0], batch_size, size, device, steps, warmup))
        report["sizes"] = {"setting": settings[0].label,
                           "results": compared(by_size, max(sizes))}
        progress(report)
    # the peer's settings come last, when measured
    baseline = results[-1]["images_per_s"] if PEER in settings else None
    for result in results:
        result["ratio_to_peer"] = result["images_per_s"] / baseline if baseline else None
    progress(report)
    return report


@dataclass(frozen=True)
class SyncBenchJob:
    arch: str
    batch_size: int
    image_size: int
    steps: int
    warmup: int
    result_file: str
    compile: str = "off"  # off | whole | regions: compiled()
    compile_backend: str = "inductor"


def sync_process(job: SyncBenchJob, env: WorkerEnv, plan, cpu_workers: int) -> None:
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
    sys.exit(launch(sync_process, job, devices, mode, parallel))


SYNC_MODES = ("local", "ps", "allreduce")


def run_sync(arch: str, batch_size: int, image_size: int, devices: list[str], steps: int,
             warmup: int, bucket_mb: float, compile: str = "off",
             compile_backend: str = "inductor", modes: tuple[str, ...] = SYNC_MODES,
             progress: Callable[[dict], None] = lambda report: None) -> dict:
    """Step time on the same model and per-worker batch: 1 worker (`local`: no sync), N workers
    with the parameter server, N with all-reduce, one after the other, each in a process of its
    own, so that one mode's GPU memory (the caching allocator keeps it) is gone before the next
    starts; `progress` gets the report after each."""
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

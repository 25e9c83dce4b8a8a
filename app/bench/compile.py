"""What compiling costs and gives, whole model vs regions (each block of the stages), with eager
beside them: the first step, compilation included, and the median and best step after it, on a
synthetic batch. On a shared machine, trust the best step and the first step's CPU time:
compiling is mostly one busy thread (inductor's C++ compiler runs in other processes: not
counted). Each setting runs in a fresh process with an empty inductor cache, so every first
step compiles from scratch."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from app.bench.model import compiled, synthetic_batch
from app.models.factory import create_model
from app.runtime.private_api import compiled_graphs
from app.training.precision import Precision


@dataclass(frozen=True)
class CompileBenchJob:
    arch: str
    batch_size: int
    image_size: int
    device: str
    backend: str
    steps: int
    setting: str
    result_file: str


def measure(job: CompileBenchJob) -> None:
    """In a process of its own: writes {first_step_s, step_times_s, graphs} to result_file."""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read when inductor first needs it
        os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")  # GPU kernels
        precision = Precision.from_config("auto", True, job.device)
        torch.manual_seed(0)
        model = precision.prepare_model(create_model(job.arch, 1000))
        forward = compiled(model, job.setting, job.batch_size, job.backend)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        images, labels = synthetic_batch(precision, job.batch_size, job.image_size)
        on_cuda = precision.device.type == "cuda"

        def step() -> float:
            started = time.perf_counter()
            with precision.autocast():
                loss = nn.functional.cross_entropy(forward(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if on_cuda:
                torch.cuda.synchronize(precision.device)
            return time.perf_counter() - started

        cpu_started = time.process_time()
        first_step_s = step()
        first_step_cpu_s = time.process_time() - cpu_started
        times = [step() for _ in range(job.steps)]
    graphs = compiled_graphs()
    Path(job.result_file).write_text(json.dumps({
        "first_step_s": first_step_s, "first_step_cpu_s": first_step_cpu_s,
        "step_times_s": times, "graphs": graphs}))


def in_process(target: Callable, args: tuple, what: str) -> None:
    """`target(*args)` in a spawned process of its own; raises if it fails."""
    process = torch.multiprocessing.get_context("spawn").Process(target=target, args=args)
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"{what} failed (exit {process.exitcode})")


def run(arch: str, batch_size: int, image_size: int, device: str, backend: str, steps: int,
        settings: list[str]) -> dict:
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for setting in settings:
            job = CompileBenchJob(arch, batch_size, image_size, device, backend, steps, setting,
                                  str(Path(folder) / f"{setting}.json"))
            in_process(measure, (job,), f"compile benchmark '{setting}'")
            result = json.loads(Path(job.result_file).read_text())
            results.append({**asdict(job), **result,
                            "step_s": statistics.median(result["step_times_s"]),
                            "best_step_s": min(result["step_times_s"])})
    return {"what": "compile", "results": results, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}


def format_report(report: dict) -> str:
    first = report["results"][0]
    lines = [f"compile: {first['arch']}, batch {first['batch_size']}, {first['image_size']} px,"
             f" {first['device']}, backend {first['backend']}, median of {first['steps']} steps",
             f"{'setting':<10}{'first step':>12}{'(CPU time)':>12}{'step':>12}{'best step':>12}"
             f"{'graphs':>8}"]
    for r in report["results"]:
        lines.append(f"{r['setting']:<10}{r['first_step_s']:>11.1f}s{r['first_step_cpu_s']:>11.1f}s"
                     f"{r['step_s'] * 1000:>10.1f}ms{r['best_step_s'] * 1000:>10.1f}ms"
                     f"{r['graphs']:>8}")
    return "\n".join(lines)

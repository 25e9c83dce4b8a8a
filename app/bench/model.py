"""Model-only throughput: a synthetic batch already on the device, forward + backward + SGD
step, so neither the input pipeline nor the gradient sync counts. Our settings (bf16 autocast,
channels_last, torch.compile on CUDA) beside the peer's numerics (pytorch/examples imagenet:
fp32 NCHW, eager, cuDNN autotuning on), measured in the same run."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from app.models import create_model
from app.precision import Precision
from app.speed import configure_backends


@dataclass(frozen=True)
class ModelSetting:
    label: str
    amp: str  # auto | bf16 | fp16 | off
    channels_last: bool
    compile: bool


OURS = ModelSetting("ours: bf16, channels_last, compiled", "auto", True, True)
OURS_EAGER = ModelSetting("ours without compile", "auto", True, False)
PEER = ModelSetting("pytorch/examples: fp32, NCHW", "off", False, False)


def measure(arch: str, setting: ModelSetting, batch_size: int, image_size: int, device: str,
            steps: int, warmup: int) -> dict:
    """Images/s over `steps` timed steps after `warmup` (the first includes compilation)."""
    precision = Precision.from_config(setting.amp, setting.channels_last, device)
    configure_backends(precision.device, cudnn_benchmark=True, tf32=True)
    torch.manual_seed(0)
    model = precision.prepare_model(create_model(arch, 1000))
    forward = torch.compile(model) if setting.compile else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    memory_format = torch.channels_last if precision.channels_last else torch.contiguous_format
    images = torch.randn(batch_size, 3, image_size, image_size, device=precision.device
                         ).contiguous(memory_format=memory_format)
    labels = torch.randint(0, 1000, (batch_size,), device=precision.device)
    on_cuda = precision.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(precision.device)

    def step() -> None:
        with precision.autocast():
            loss = torch.nn.functional.cross_entropy(forward(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def wait() -> None:
        if on_cuda:
            torch.cuda.synchronize(precision.device)

    started = time.perf_counter()
    step()
    wait()
    first_step_s = time.perf_counter() - started
    for _ in range(warmup):
        step()
    wait()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    wait()
    seconds = time.perf_counter() - started
    return {**asdict(setting), "arch": arch, "batch_size": batch_size,
            "image_size": image_size, "device": str(precision.device),
            "images_per_s": batch_size * steps / seconds, "step_ms": 1000 * seconds / steps,
            "first_step_s": first_step_s,
            "peak_memory_gb": torch.cuda.max_memory_allocated(precision.device) / 2**30
            if on_cuda else None}


def run(arch: str, batch_size: int, image_size: int, device: str, steps: int, warmup: int,
        settings: list[ModelSetting]) -> dict:
    results = [measure(arch, s, batch_size, image_size, device, steps, warmup)
               for s in settings]
    baseline = results[-1]["images_per_s"]  # the peer's settings come last
    for result in results:
        result["ratio_to_peer"] = result["images_per_s"] / baseline
    return {"what": "model only", "results": results, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}


def format_report(report: dict) -> str:
    first = report["results"][0]
    lines = [f"model only: {first['arch']}, batch {first['batch_size']}, "
             f"{first['image_size']} px, {first['device']}",
             f"{'setting':<40}{'images/s':>10}{'vs peer':>9}{'first step':>12}{'peak GB':>9}"]
    for r in report["results"]:
        peak = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        lines.append(f"{r['label']:<40}{r['images_per_s']:>10.1f}{r['ratio_to_peer']:>9.2f}"
                     f"{r['first_step_s']:>11.1f}s{peak:>9}")
    return "\n".join(lines)

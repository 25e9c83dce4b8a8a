"""Model-only throughput: a synthetic batch already on the device, forward + backward + SGD
step, so neither the input pipeline nor the gradient sync counts. Our settings beside the peer's
numerics (pytorch/examples: fp32 NCHW, eager), measured in the same run; batch augmentations, a
recipe's optimizer, clipping, the EMA update and a grid of image sizes x batch sizes x
optimizer-step implementations are each measured beside the plain step."""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from app.config import AugmentConfig, OptimConfig
from app.data.batch_augment import BatchAugment
from app.models.factory import create_model
from app.training.ema import ModelEma
from app.training.optim import build_optimizer, clip_gradients
from app.training.precision import Precision
from app.training.speed import CompiledForFullBatches, configure_backends


@dataclass(frozen=True)
class ModelSetting:
    label: str
    amp: str  # auto | bf16 | fp16 | off
    channels_last: bool
    compile: bool  # the whole model, or with `regions` each block of its stages
    regions: bool = False
    backend: str = "inductor"  # torch.compile's


OURS = ModelSetting("ours: bf16, channels_last, compiled", "auto", True, True)
OURS_EAGER = ModelSetting("ours without compile", "auto", True, False)
# compiled as training compiles: each block of the stages (app/training/speed.py)
OURS_REGIONS = ModelSetting("ours: bf16, channels_last, compiled by regions", "auto", True,
                            True, regions=True)
PEER = ModelSetting("pytorch/examples: fp32, NCHW", "off", False, False)
# the plain SGD step's implementation: torch's default (foreach on CUDA, a loop on a CPU),
# foreach kernels (a few launches per parameter group) or one fused kernel
OPTIMIZER_STEPS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


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
            optim: OptimConfig | None = None, ema_every: int = 0,
            optimizer_step: str = "default") -> dict:
    """Images/s over `steps` timed steps after `warmup` (the first includes compilation);
    `augment` augments each batch first, as the Trainer does; `ema_every`: the weights' moving
    average updated every that many steps; `optimizer_step`: a key of OPTIMIZER_STEPS."""
    precision = Precision.from_config(setting.amp, setting.channels_last, device)
    configure_backends(precision.device, cudnn_benchmark=True, tf32=True)
    torch.manual_seed(0)
    model = precision.prepare_model(create_model(arch, 1000))
    # a fresh cache, static shapes: each size gets its own graph, as in training, not the
    # dynamic-shape graph a second size would turn the cached one into
    torch.compiler.reset()
    forward = compiled(model, ("regions" if setting.regions else "whole") if setting.compile
                       else "off", batch_size, setting.backend)
    # plain SGD unless a recipe's optimizer (and clipping) is asked for, built as training does
    optimizer = build_optimizer(model, optim, batch_size) if optim else \
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                        **OPTIMIZER_STEPS[optimizer_step])
    images, labels = synthetic_batch(precision, batch_size, image_size)
    ema = ModelEma(model, decay=0.999, every=ema_every) if ema_every else None
    counter, on_cuda = itertools.count(), precision.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(precision.device)

    def step() -> None:  # on the same tensors every step: the values drift, the work does not
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

    first_step_s, seconds = timed(step, steps, warmup, precision.device)
    label = setting.label + (" + batch augment" if augment else "") + (
        f" + {optim.optimizer}" + (f", clip {optim.clip_grad_norm:g}" if optim.clip_grad_norm
                                   else "") if optim else "") + (
        f" + EMA every {ema_every}" if ema_every else "")
    return {**asdict(setting), "label": label, "arch": arch, "batch_size": batch_size,
            "image_size": image_size, "optimizer_step": optimizer_step,
            "device": str(precision.device),
            "images_per_s": batch_size * steps / seconds, "step_ms": 1000 * seconds / steps,
            "first_step_s": first_step_s,
            "peak_memory_gb": torch.cuda.max_memory_allocated(precision.device) / 2**30
            if on_cuda else None}


def timed(step: Callable[[], object], steps: int, warmup: int, device: torch.device
          ) -> tuple[float, float]:
    """(seconds of the first step, compilation included; seconds of `steps` steps after
    `warmup` more), the device's queue waited for."""
    wait = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    started = time.perf_counter()
    step()
    wait()
    first = time.perf_counter() - started
    for _ in range(warmup):
        step()
    wait()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    wait()
    return first, time.perf_counter() - started


def augment_alone_ms(augment: BatchAugment, batch_size: int, image_size: int, device: str,
                     steps: int) -> float:
    """Milliseconds per batch of the augmentations by themselves (host draws included)."""
    device, counter = torch.device(device), itertools.count()
    images = torch.randn(batch_size, 3, image_size, image_size, device=device)
    labels = torch.randint(0, augment.num_classes, (batch_size,), device=device)
    return 1000 * timed(lambda: augment(images, labels, next(counter)), steps, 0, device)[1] / \
        steps


def compared(rows: list[dict], largest: int, first_step: str) -> list[dict]:
    """The grid's rows, each against the largest size at the same batch and step (beside the
    pixel ratio: what progressive resizing can buy) and against the first step kind at the
    same shape (None while that row is to come)."""
    def speed_against(row: dict, size: int, kind: str) -> float | None:
        other = next((r for r in rows if (r["batch_size"], r["image_size"], r["optimizer_step"])
                      == (row["batch_size"], size, kind)), None)
        return row["images_per_s"] / other["images_per_s"] if other else None
    kept = ("batch_size", "image_size", "optimizer_step", "images_per_s", "step_ms",
            "first_step_s", "peak_memory_gb")
    return [{**{key: r[key] for key in kept},
             "speed_vs_largest": speed_against(r, largest, r["optimizer_step"]),
             "pixels_vs_largest": (largest / r["image_size"]) ** 2,
             "speed_vs_first_step": speed_against(r, r["image_size"], first_step)}
            for r in rows]


def run(arch: str, batch_size: int, image_size: int, device: str, steps: int, warmup: int,
        settings: list[ModelSetting], augment: AugmentConfig | None = None,
        sizes: list[int] | None = None, optimizers: list[OptimConfig] | None = None,
        ema_every: int = 0, batch_sizes: list[int] | None = None,
        step_kinds: list[str] | None = None,
        progress: Callable[[dict], None] = lambda report: None) -> dict:
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
    if sizes or batch_sizes or step_kinds:  # our first setting at every (batch, size, step)
        sizes, kinds, rows = sizes or [image_size], step_kinds or ["default"], []
        for batch, size, kind in itertools.product(batch_sizes or [batch_size], sizes, kinds):
            rows.append(measure(arch, settings[0], batch, size, device, steps, warmup,
                                optimizer_step=kind))
            report["sizes"] = {"setting": settings[0].label,
                               "results": compared(rows, max(sizes), kinds[0])}
            progress(report)
    # the peer's settings come last, when measured
    baseline = results[-1]["images_per_s"] if PEER in settings else None
    for result in results:
        result["ratio_to_peer"] = result["images_per_s"] / baseline if baseline else None
    progress(report)
    return report

"""Replicas as threads vs as processes: images/s of the same training through the Python API
(app.train), same model, data, batch and devices, in one run. Measured end to end, from the
print intervals after the first (start-up and the first batches left out)."""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Callable

import torch

from app.loggers.plots import load_metrics
from app.launch.api_inputs import resolve_devices
from app.launch.python_api import open_catalog, prepare_training, train
from app.models.factory import create_model

MODES = ("processes", "threads")


def run(arch: str, batch_size: int, image_size: int, devices: list[str], dataset: str,
        catalog: str, workers: int, steps: int,
        progress: Callable[[dict], None] = lambda report: None) -> dict:
    """`devices` ["all"]: a replica per GPU (fewer than two: nothing to compare). Both modes
    train eagerly: threads cannot compile (torch.compile is not thread-safe), and compiled
    processes would be measured against eager threads."""
    if devices == ["all"]:
        devices = resolve_devices("all")
        if len(devices) < 2:
            return {"skipped": f"--devices all: one device ({devices[0]}), nothing to compare"}
    data = open_catalog(catalog).dataset(dataset)
    train_set = data.split("train")
    val_set = data.split("val")
    results: list[dict] = []
    report = {"arch": arch, "batch_per_replica": batch_size, "image_size": image_size,
              "devices": devices, "dataset": dataset, "train_images": len(train_set),
              "workers": workers, "compile": "off", "results": results,
              "threads_over_processes": None, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as folder:
        for mode in MODES:
            torch.manual_seed(0)
            model = create_model(arch, train_set.num_classes)
            setup = prepare_training(
                model, train_set, devices=devices, parallel=mode, batch_size=batch_size,
                image_size=image_size, epochs=1, workers=workers, print_freq=max(1, steps // 10),
                optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                output_dir=folder, run_name=mode, compile="off")
            started = time.perf_counter()
            train(setup, loss=torch.nn.CrossEntropyLoss(), val=val_set, logger=[])
            rates = load_metrics(setup.run_dir / "metrics.jsonl")["train/images_per_sec"] \
                .dropna().tolist()
            results.append({"mode": mode, "images_per_s": statistics.median(rates[1:] or rates),
                            "intervals": rates, "wall_s": time.perf_counter() - started})
            progress(report)
    by_mode = {r["mode"]: r for r in results}
    report["threads_over_processes"] = by_mode["threads"]["images_per_s"] / \
        by_mode["processes"]["images_per_s"]
    progress(report)
    return report


def format_report(report: dict) -> str:
    if "skipped" in report:
        return report["skipped"]
    lines = [f"{report['arch']}, batch {report['batch_per_replica']} per replica, eager, "
             f"{report['image_size']} px, devices {','.join(report['devices'])}, "
             f"{report['dataset']} ({report['train_images']} train images), -j "
             f"{report['workers']}; median images/s over the print intervals after the first",
             f"{'replicas as':<14}{'images/s':>12}{'wall s':>10}"]
    for r in report["results"]:
        lines.append(f"{r['mode']:<14}{r['images_per_s']:>12.1f}{r['wall_s']:>10.1f}")
    lines.append(f"threads / processes: {report['threads_over_processes']:.3f}")
    return "\n".join(lines)

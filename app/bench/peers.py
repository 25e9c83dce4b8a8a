"""`bin/bench.py peers`: one training, three trainers, the same photos on the same machine.

- ours: bin/driver.py with a recipe config (`--config`, e.g. configs/imagenette_cpu.toml);
- pytorch/examples: its imagenet/main.py recipe in one process (app/bench/peer_main.py:
  torchvision's transforms and model, SGD 0.1 with a step schedule, DataLoader processes);
- timm: its train.py, from a pytorch-image-models checkout named by `--timm-train` (it is not
  part of the timm package), with its own defaults.

Same model, epochs, batch size, image size and loader processes; anything else is each
trainer's own recipe, as its users run it. One run per seed and trainer, interleaved (seed 0:
ours, examples, timm; then seed 1 ...) so that a change in the machine's load meets all three.
Each run's final val top-1 and its wall time from the command to its exit (imports, loading and
validation included), then per trainer the mean, the spread and the wall time's ratio to ours.
"""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
TRAINERS = ("ours", "examples", "timm")
RUN_TIMEOUT_S = 4 * 3600.0


@dataclass(frozen=True)
class Setup:
    catalog: str
    dataset: str  # a catalog entry with the imagefolder layout on local disk
    config: str  # our recipe
    arch: str
    image_size: int
    batch_size: int
    epochs: int
    workers: int  # loader processes
    timm_train: str = ""  # pytorch-image-models' train.py


def imagefolder_root(setup: Setup) -> Path:
    """The entry's folder (train/<class>/, val/<class>/), which the peers read directly."""
    from app.catalog import Catalog  # noqa: PLC0415 (pandas: not for bench.py --help)
    root = Catalog.load(setup.catalog).open(setup.dataset, report=print)
    if root.layout != "imagefolder" or not root.is_local:
        raise SystemExit(f"peers: dataset '{setup.dataset}' must be an imagefolder on local "
                         f"disk (it is {root.layout} at {root.url}): the peers read folders")
    return Path(root.root)


def ours_command(setup: Setup, seed: int, out: Path, root: Path) -> list[str]:
    return [sys.executable, str(REPO / "bin" / "driver.py"), "--catalog", setup.catalog,
            "--dataset", setup.dataset, "--config", setup.config, "-a", setup.arch,
            "--image-size", str(setup.image_size), "-b", str(setup.batch_size),
            "--epochs", str(setup.epochs), "-j", str(setup.workers), "--seed", str(seed),
            "--output-dir", str(out), "--run-name", "peers", "-p", "50"]


def examples_command(setup: Setup, seed: int, out: Path, root: Path) -> list[str]:
    return [sys.executable, "-m", "app.bench.peer_main", str(root), "-a", setup.arch,
            "--image-size", str(setup.image_size), "-b", str(setup.batch_size),
            "--epochs", str(setup.epochs), "-j", str(setup.workers), "--seed", str(seed),
            "--out", str(out)]


def timm_command(setup: Setup, seed: int, out: Path, root: Path) -> list[str]:
    # train.py's defaults otherwise, but for its 5 warmup epochs: as long as a short run itself
    return [sys.executable, setup.timm_train, "--data-dir", str(root), "--train-split", "train",
            "--val-split", "val", "--model", setup.arch, "--num-classes", str(classes(root)),
            "--img-size", str(setup.image_size),
            "-b", str(setup.batch_size), "--epochs", str(setup.epochs),
            "--warmup-epochs", str(min(5, max(1, setup.epochs // 5))),
            "-j", str(setup.workers), "--seed", str(seed), "--device", "cpu",
            "--no-prefetcher", "--output", str(out), "--experiment", "peers",
            "--checkpoint-hist", "1", "--log-interval", "50"]


def classes(root: Path) -> int:
    """train.py builds a 1,000-class head unless told; main.py's ImageFolder counts them."""
    return sum(1 for folder in (root / "train").iterdir() if folder.is_dir())


def ours_top1(out: Path, stdout: str) -> float:
    records = [json.loads(line) for line in (out / "peers" / "metrics.jsonl").read_text()
               .splitlines() if '"val/top1"' in line]
    return records[-1]["val/top1"]


def examples_top1(out: Path, stdout: str) -> float:
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"epoch"')]
    return records[-1]["top1"]


def timm_top1(out: Path, stdout: str) -> float:
    with open(out / "peers" / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return float(rows[-1]["eval_top1"]) / 100  # train.py writes percent


COMMANDS: dict[str, Callable[[Setup, int, Path, Path], list[str]]] = {
    "ours": ours_command, "examples": examples_command, "timm": timm_command}
TOP1: dict[str, Callable[[Path, str], float]] = {
    "ours": ours_top1, "examples": examples_top1, "timm": timm_top1}


def run_one(trainer: str, setup: Setup, seed: int, root: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"peers-{trainer}-") as folder:
        out = Path(folder)
        command = COMMANDS[trainer](setup, seed, out, root)
        started = time.time()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
        wall = time.time() - started
        if done.returncode:
            raise RuntimeError(f"{trainer} (seed {seed}) failed with exit {done.returncode}: "
                               f"{done.stderr[-3000:]}")
        return {"trainer": trainer, "seed": seed, "top1": TOP1[trainer](out, done.stdout),
                "wall_s": wall}


def run(setup: Setup, trainers: list[str], seeds: list[int],
        save: Callable[[dict], None]) -> dict:
    root = imagefolder_root(setup)
    report: dict = {"setup": asdict(setup), "root": str(root), "runs": [], "summary": {}}
    for seed in seeds:
        for trainer in trainers:
            result = run_one(trainer, setup, seed, root)
            print(f"{trainer:9s} seed {seed}: top-1 {result['top1']:.4f}  "
                  f"{result['wall_s']:.0f} s", flush=True)
            report["runs"].append(result)
            report["summary"] = summarise(report["runs"], trainers)
            save(report)
    return report


def summarise(runs: list[dict], trainers: list[str]) -> dict:
    summary = {}
    for trainer in trainers:
        mine = [run for run in runs if run["trainer"] == trainer]
        if not mine:
            continue
        top1 = [run["top1"] for run in mine]
        summary[trainer] = {"seeds": len(mine), "top1_mean": statistics.fmean(top1),
                            "top1_min": min(top1), "top1_max": max(top1),
                            "wall_s_mean": statistics.fmean(run["wall_s"] for run in mine)}
    base = summary.get(trainers[0])
    for row in summary.values():
        row["wall_vs_first"] = row["wall_s_mean"] / base["wall_s_mean"] if base else None
    return summary


def format_report(report: dict) -> str:
    setup = report["setup"]
    lines = [f"{setup['arch']}, {setup['image_size']} px, {setup['epochs']} epochs, batch "
             f"{setup['batch_size']}, -j {setup['workers']}, {report['root']}",
             f"{'trainer':10s} {'seeds':>5s} {'top-1 mean':>10s} {'min-max':>15s} "
             f"{'wall s':>8s} {'wall vs first':>14s}"]
    for trainer, row in report["summary"].items():
        lines.append(f"{trainer:10s} {row['seeds']:5d} {row['top1_mean']:10.4f} "
                     f"{row['top1_min']:.4f}-{row['top1_max']:.4f} {row['wall_s_mean']:8.0f} "
                     f"{row['wall_vs_first']:13.2f}x")
    return "\n".join(lines)

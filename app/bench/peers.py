"""`bin/bench.py peers`: one training by several trainers on the same photos and machine: ours
(bin/driver.py with a recipe config), pytorch/examples' main.py recipe (peer_examples.py),
timm's train.py of a pytorch-image-models checkout (its own defaults or, with `--peer-recipe
ours`, our config's recipe in its flags) and fastai running the Imagenette 128 px / 5-epoch
row's holder's recipe (peer_fastai.py). Same epochs, batch size, image size and loader
processes; the rest is each trainer's own, as its users run it. The runs are interleaved by
seed so that a change in the machine's load meets them all. Each run records its command,
per-epoch top-1, wall and CPU time and, where the trainer says, the images/s of its training
steps."""

from __future__ import annotations

import csv
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from app.bench.probe import machine

REPO = Path(__file__).resolve().parents[2]
TRAINERS = ("ours", "examples", "timm", "fastai")
RUN_TIMEOUT_S = 4 * 3600.0
# where `make peer-fastai` installs fastai and what it needs beyond the training dependencies
FASTAI_SITE = REPO / ".peers" / "fastai"
EXIT_S = 5.0  # under a deadline: the report written and the process gone before it
# Under a deadline, a trainer's first run is expected to last this much longer than the
# longest so far (pytorch/examples' recipe trains in fp32 and autotunes cuDNN), a later one
# its own longest so far, with room for noise.
FIRST_RUN_FACTOR, RUN_FACTOR = 2.0, 1.2


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
    device: str = "cpu"  # or cuda: one GPU each
    peer_arch: str = ""  # the peers' model where ours is one torchvision lacks (resnet50d)
    peer_recipe: str = "own"  # "ours": timm's train.py runs our config's recipe
    ours_args: str = ""  # more of the driver's flags for ours (a variant of the recipe)


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
            "--device", setup.device, "--output-dir", str(out), "--run-name", "peers",
            "-p", "50", *shlex.split(setup.ours_args)]


def examples_command(setup: Setup, seed: int, out: Path, root: Path) -> list[str]:
    return [sys.executable, "-m", "app.bench.peer_examples", str(root), "-a",
            setup.peer_arch or setup.arch,
            "--image-size", str(setup.image_size), "-b", str(setup.batch_size),
            "--epochs", str(setup.epochs), "-j", str(setup.workers), "--seed", str(seed),
            "--device", "cuda" if setup.device.startswith("cuda") else "cpu", "--out", str(out)]


def timm_command(setup: Setup, seed: int, out: Path, root: Path) -> list[str]:
    # train.py's defaults otherwise, but for its 5 warmup epochs: as long as a short run itself
    recipe = timm_recipe_flags(setup) if setup.peer_recipe == "ours" else (
        "--epochs", str(setup.epochs), "--warmup-epochs", str(min(5, max(1, setup.epochs // 5))))
    # train.py builds a 1,000-class head unless told; main.py's ImageFolder counts the classes
    classes = sum(1 for folder in (root / "train").iterdir() if folder.is_dir())
    return [sys.executable, setup.timm_train, "--data-dir", str(root), "--train-split", "train",
            "--val-split", "val", "--model", setup.peer_arch or setup.arch, "--num-classes",
            str(classes), "--img-size", str(setup.image_size), "-b", str(setup.batch_size),
            *recipe, "-j", str(setup.workers), "--seed", str(seed), "--output", str(out),
            "--experiment", "peers", "--checkpoint-hist", "1", "--log-interval", "50",
            # on a GPU, what timm's README runs: its CUDA prefetcher, AMP, channels_last
            *(("--device", "cuda", "--amp", "--channels-last") if setup.device.startswith("cuda")
              else ("--device", "cpu", "--no-prefetcher"))]


def fastai_command(setup: Setup, seed: int, out: Path, root: Path) -> list[str]:
    """The holder's recipe at the setup's size, batch, epochs and loader processes (its LR and
    weight decay are the notebook's: 1e-2 at batch 32, 1e-4); fastai on the path (fastai_env)."""
    return [sys.executable, "-m", "app.bench.peer_fastai", str(root), "--size",
            str(setup.image_size), "--bs", str(setup.batch_size), "--epochs", str(setup.epochs),
            "--workers", str(setup.workers), "--seed", str(seed)]


def fastai_env() -> dict[str, str]:
    if not (FASTAI_SITE / "fastai").is_dir():
        raise SystemExit(f"peers: fastai is not installed in {FASTAI_SITE}: run "
                         "`make peer-fastai` first")
    path = os.pathsep.join(filter(None, (str(FASTAI_SITE), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path}


def timm_recipe_flags(setup: Setup) -> tuple[str, ...]:
    """Our config's recipe in train.py's flags. FFCV's one-cycle (linear up to the peak epoch,
    linear down to zero at the last) is train.py's `poly` schedule of power 1 after a warmup
    prefix of the peak's epochs (a prefix adds its epochs to --epochs, hence the difference),
    stepped per update; timm's `sgd` is Nesterov's and keeps norms and biases out of the
    decay, as ours; its LR is absolute (ours is per 256 images); no colour jitter, as ours;
    on a CPU, our precision (bf16 in channels_last where the CPU computes bf16; on a GPU
    timm_command gives it AMP). Progressive resizing has no train.py flag: a recipe with it is
    refused."""
    from app.config.sources import file_overrides, make_config  # noqa: PLC0415
    from app.data.resolution import DEFAULT_CROP_FRACTION  # noqa: PLC0415
    config = make_config(file_overrides(str(REPO / setup.config)))
    precision = () if setup.device.startswith("cuda") else cpu_precision_flags(config.train)
    optim, data = config.optim, config.data
    peak = round(optim.lr_peak_epoch)
    crop = data.val_crop_size or setup.image_size
    if optim.schedule != "ffcv" or optim.optimizer != "sgd" or not optim.nesterov \
            or peak != optim.lr_peak_epoch or not 0 < peak < setup.epochs \
            or data.progressive_start_size:
        raise SystemExit(f"peers --peer-recipe ours: {setup.config} must be SGD with Nesterov "
                         "momentum and the ffcv schedule peaking at a whole epoch before the "
                         "last, without progressive resizing (train.py has no flags for the rest)")
    return ("--epochs", str(setup.epochs - peak), "--warmup-epochs", str(peak),
            "--warmup-prefix", "--warmup-lr", "0", "--sched", "poly", "--decay-rate", "1",
            "--min-lr", "0", "--sched-on-updates", "--opt", "sgd",
            "--lr", f"{optim.lr * setup.batch_size / 256:g}", "--momentum", f"{optim.momentum:g}",
            "--weight-decay", f"{optim.weight_decay:g}",
            "--smoothing", f"{optim.label_smoothing:g}", "--color-jitter", "0",
            # our val centre crop's share of the resized side (timm's resnet18 default: 0.95)
            "--crop-pct", f"{crop / (data.val_resize_size or crop / DEFAULT_CROP_FRACTION):.4f}",
            *precision)


def cpu_precision_flags(train) -> tuple[str, ...]:
    """What our config's precision (`amp`, `channels_last`) is on this CPU, in train.py's flags."""
    import torch  # noqa: PLC0415

    from app.training.precision import Precision  # noqa: PLC0415
    ours = Precision.from_config(train.amp, train.channels_last, "cpu")
    bf16 = ("--amp", "--amp-dtype", "bfloat16") if ours.autocast_dtype is torch.bfloat16 else ()
    return (*bf16, *(("--channels-last",) if ours.channels_last else ()))


# Each trainer's epochs, in order: (top-1, images trained and the seconds their steps took, or
# None where the trainer does not say).
Epoch = tuple[float, tuple[int, float] | None]


def ours_epochs(out: Path, stdout: str) -> list[Epoch]:
    records = [json.loads(line) for line in (out / "peers" / "metrics.jsonl").read_text()
               .splitlines() if '"val/top1"' in line]
    return [(record["val/top1"], (record["train/images"], record["train/images"]
                                  / record["train/epoch_images_per_sec"])) for record in records]


def printed_epochs(out: Path, stdout: str) -> list[Epoch]:
    """main.py's and fastai's JSON lines (only fastai's say what the training steps took)."""
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"epoch"')]
    return [(record["top1"], (record["train_images"], record["train_s"])
             if "train_s" in record else None) for record in records]


def timm_epochs(out: Path, stdout: str) -> list[Epoch]:
    with open(out / "peers" / "summary.csv", newline="") as handle:  # train.py writes percent
        return [(float(row["eval_top1"]) / 100, None) for row in csv.DictReader(handle)]


# each trainer's command (setup, seed, its output folder, the photos) and reading of its epochs
COMMANDS = {"ours": (ours_command, ours_epochs), "examples": (examples_command, printed_epochs),
            "timm": (timm_command, timm_epochs), "fastai": (fastai_command, printed_epochs)}


def run_one(trainer: str, setup: Setup, seed: int, root: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"peers-{trainer}-") as folder:
        out = Path(folder)
        command, epochs_of = COMMANDS[trainer][0](setup, seed, out, root), COMMANDS[trainer][1]
        env = fastai_env() if trainer == "fastai" else None
        cpu_before, started = children_cpu_s(), time.time()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env,
                              timeout=RUN_TIMEOUT_S)
        ended = time.time()
        if done.returncode:
            raise RuntimeError(f"{trainer} (seed {seed}) failed with exit {done.returncode}: "
                               f"{done.stderr[-3000:]}")
        epochs = epochs_of(out, done.stdout)
        steps = [step for _, step in epochs]
        images, seconds = (sum(column) for column in zip(*steps)) if None not in steps \
            else (None, None)
        return {"trainer": trainer, "seed": seed, "top1": epochs[-1][0],
                "wall_s": ended - started, "cpu_s": children_cpu_s() - cpu_before,
                "epoch_top1": [top1 for top1, _ in epochs], "train_images": images,
                "train_images_per_s": images / seconds if images is not None else None,
                "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
                "command": shlex.join(command)}


def children_cpu_s() -> float:
    """User and system CPU seconds of the finished child processes (and theirs) so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def expected_s(trainer: str, runs: list[dict]) -> float:
    """How long a run of `trainer` is expected to take, from the runs so far (0: no idea)."""
    own = [run["wall_s"] for run in runs if run["trainer"] == trainer]
    if own:
        return max(own) * RUN_FACTOR
    return max((run["wall_s"] for run in runs), default=0.0) * FIRST_RUN_FACTOR


def run(setup: Setup, trainers: list[str], seeds: list[int], save: Callable[[dict], None],
        deadline_s: float = 0.0) -> dict:
    """Every run, the report saved after each. Under a deadline (seconds from now; a part of
    gpu-check is told its own) the first trainer's seeds come first, and a run starts only if
    it is expected to end in time: a part killed mid-run would be a failed part."""
    started = time.monotonic()
    root = imagefolder_root(setup)
    report = {"setup": asdict(setup), "root": str(root), "machine": machine(),
              "runs": [], "summary": {}, **({"deadline_s": deadline_s, "not_run": []}
                                            if deadline_s else {})}
    order = [(trainer, seed) for trainer in trainers for seed in seeds] if deadline_s else \
        [(trainer, seed) for seed in seeds for trainer in trainers]
    for trainer, seed in order:
        left, expected = deadline_s - EXIT_S - (time.monotonic() - started), \
            expected_s(trainer, report["runs"])
        if deadline_s and expected > left:
            report["not_run"].append({"trainer": trainer, "seed": seed, "expected_s": expected,
                                      "left_s": max(0.0, left)})
        else:
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
        speeds = [run.get("train_images_per_s") for run in mine]
        summary[trainer] = {"seeds": len(mine), "top1_mean": statistics.fmean(top1),
                            "top1_min": min(top1), "top1_max": max(top1),
                            # the mean's standard error, from the seeds' spread
                            "top1_sem": statistics.stdev(top1) / len(top1) ** 0.5
                            if len(top1) > 1 else None,
                            "wall_s_mean": statistics.fmean(run["wall_s"] for run in mine),
                            "train_images_per_s_mean": statistics.fmean(speeds)
                            if None not in speeds else None}
    base = summary.get(trainers[0])
    for row in summary.values():
        row["wall_vs_first"] = row["wall_s_mean"] / base["wall_s_mean"] if base else None
    return summary

"""gpu-check's imagenette part: Imagenette's leaderboard row at 128 px, 5 epochs (fastai/
imagenette: 85.77% top-1, the mean of 5 runs) trained by our driver with its recipe
(configs/imagenette_128_5.toml), seed after seed; then, in what is left of the part's time,
pytorch/examples' main.py recipe at the same budget: `bin/bench.py peers`' runs and report,
each run's top-1 and wall time written the moment it ends. The photos are the user's copy
(IMAGENETTE_ROOT: the catalog's imagenette_local) or else fast.ai's archive (the catalog's
imagenette, downloaded on first use); a machine with neither (offline, no copy) skips the part,
saying why.

A run starts only if it is expected to end within the part's deadline (--deadline, else the
runner's): a part killed mid-run would be a failed part."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Callable

from app.bench import peers, reports
from app.bench.cli import build_parser, peers_run, saver
from app.bench.part_runner import DEADLINE_ENV
from app.runtime.cli import run_cli
from app.runtime.errors import UserError, first_line

TARGET = 0.8577  # the leaderboard's top-1 for 128 px, 5 epochs
CONFIG = "configs/imagenette_128_5.toml"
EXIT_S = 5.0  # the report written and the process gone before the deadline
# A trainer's first run is expected to last this much longer than the longest run so far
# (pytorch/examples' recipe trains in fp32 and autotunes cuDNN)
FIRST_RUN_FACTOR = 2.0
RUN_FACTOR = 1.2  # a later run of the same trainer: its longest so far, with room for noise


def row_flags() -> list[str]:
    """The row as `bin/bench.py peers` flags: the config's model and batch size (one place
    says the recipe); the peer's model is torchvision's ResNet-50 (it has no SE-ResNeXt)."""
    from app.config.sources import file_overrides, make_config  # noqa: PLC0415
    config = make_config(file_overrides(str(peers.REPO / CONFIG)))
    dataset = "imagenette_local" if os.environ.get("IMAGENETTE_ROOT") else "imagenette"
    return ["peers", "--dataset", dataset, "--config", CONFIG, "-a", config.model.arch,
            "--peer-arch", "resnet50", "--image-size", "128", "-b",
            str(config.train.batch_size), "--epochs", "5", "-j", "12", "--device", "cuda:0",
            "--trainers", "ours,examples", "--seeds", "0,1,2", "--target", str(TARGET)]


def arguments(argv: list[str]) -> tuple[argparse.Namespace, float]:
    """(peers' arguments: the row's, then the caller's flags over them; the deadline)."""
    own = argparse.ArgumentParser(prog="python -m app.bench.imagenette",
                                  description=__doc__.split("\n\n")[0])
    own.add_argument("--deadline", type=float, default=float(os.environ.get(DEADLINE_ENV, 0)),
                     help="seconds: start no run expected to end later (0: no limit)")
    found, rest = own.parse_known_args(argv)
    return build_parser().parse_args([*row_flags(), *rest]), found.deadline


def expected_s(trainer: str, runs: list[dict]) -> float:
    """How long a run of `trainer` is expected to take, from the runs so far (0: no idea)."""
    own = [run["wall_s"] for run in runs if run["trainer"] == trainer]
    if own:
        return max(own) * RUN_FACTOR
    return max((run["wall_s"] for run in runs), default=0.0) * FIRST_RUN_FACTOR


def run(setup: peers.Setup, root: Path, trainers: list[str], seeds: list[int], target: float,
        deadline_s: float, save: Callable[[dict], None], started: float) -> dict:
    """Ours for every seed, then the peer for every seed, each while it fits the deadline
    counted from `started` (time.monotonic())."""
    report = {**peers.new_report(setup, root, target), "deadline_s": deadline_s,
              "not_run": []}
    for trainer in trainers:
        for seed in seeds:
            left = deadline_s - EXIT_S - (time.monotonic() - started)
            expected = expected_s(trainer, report["runs"])
            if deadline_s and expected > left:
                report["not_run"].append({"trainer": trainer, "seed": seed,
                                          "expected_s": expected, "left_s": max(0.0, left)})
                save(report)
                continue
            peers.record(report, peers.run_one(trainer, setup, seed, root, target), trainers,
                         save)
    return report


def main(argv: list[str]) -> int:
    args, deadline = arguments(argv)
    setup, trainers, seeds, target = peers_run(args, build_parser().error)
    save, started = saver(args.json), time.monotonic()
    try:  # a download counts against the deadline
        root = peers.imagefolder_root(setup)
    except UserError as error:  # neither a copy nor the download
        save({"skipped": first_line(error)})
        print(f"imagenette: skipped: {first_line(error)}")
        return 0
    report = run(setup, root, trainers, seeds, target, deadline, save, started)
    print("\n".join(reports.peers(report)))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))

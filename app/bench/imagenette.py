"""gpu-check's imagenette part: Imagenette's leaderboard row at 128 px, 5 epochs (fastai/
imagenette: 85.77% top-1, the mean of 5 runs) trained by our driver with its recipe
(configs/imagenette_128_5.toml) on the real photos that `bin/bench.py photos receive` put
together, seed after seed; then, in what is left of the part's time, pytorch/examples' main.py
recipe at the same budget (`bin/bench.py peers`' runs). Each run's top-1 and wall time go into
the report the moment it ends; without a whole copy the part says why and skips itself.

A run starts only if it is expected to end within the part's deadline (--deadline, else the
runner's): a part killed mid-run would be a failed part."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Callable

from app.bench import peers
from app.bench.cli import saver, shared
from app.bench.part_runner import DEADLINE_ENV
from app.bench.photo_parts import missing
from app.runtime.cli import run_cli

TARGET = 0.8577  # the leaderboard's top-1 for 128 px, 5 epochs
CONFIG = "configs/imagenette_128_5.toml"
TRAINERS = ["ours", "examples"]  # timm's train.py is no package: not on a machine offline
EXIT_S = 5.0  # the report written and the process gone before the deadline
# A trainer's first run is expected to last this much longer than the longest run so far
# (pytorch/examples' recipe trains in fp32 and autotunes cuDNN)
FIRST_RUN_FACTOR = 2.0
RUN_FACTOR = 1.2  # a later run of the same trainer: its longest so far, with room for noise


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(prog="python -m app.bench.imagenette",
                                    description=__doc__.split("\n\n")[0])
    found.add_argument("--copy", required=True, help="the photos (ImageFolder) that "
                       "`bin/bench.py photos receive` put together")
    found.add_argument("--json", required=True, help="the report, written after each run")
    found.add_argument("--seeds", default="0,1,2")
    arch, batch_size = config_model_and_batch()
    shared(found, device="cuda:0", arch=(arch, "ours (the config's)"))
    found.add_argument("--peer-arch", default="resnet50", help="the peer's: torchvision "
                       f"has no {arch}")
    shared(found, image_size=128, batch_size=(batch_size, "the config's"), epochs=5,
           workers=(12, "loader processes"))
    found.add_argument("--target", type=float, default=TARGET)
    found.add_argument("--deadline", type=float, default=float(os.environ.get(DEADLINE_ENV, 0)),
                       help="seconds: start no run expected to end later (0: no limit)")
    return found


def config_model_and_batch() -> tuple[str, int]:
    """The config's model and batch size, the part's defaults: one place says the recipe."""
    from app.config.sources import file_overrides, make_config  # noqa: PLC0415
    config = make_config(file_overrides(str(peers.REPO / CONFIG)))
    return config.model.arch, config.train.batch_size


def setup_of(args: argparse.Namespace) -> peers.Setup:
    """The catalog's imagenette_local entry (IMAGENETTE_ROOT: the photos)."""
    return peers.Setup("datasets.toml", "imagenette_local", CONFIG, args.arch, args.image_size,
                       args.batch_size, args.epochs, args.workers, device=args.device,
                       peer_arch=args.peer_arch)


def expected_s(trainer: str, runs: list[dict]) -> float:
    """How long a run of `trainer` is expected to take, from the runs so far (0: no idea)."""
    own = [run["wall_s"] for run in runs if run["trainer"] == trainer]
    if own:
        return max(own) * RUN_FACTOR
    return max((run["wall_s"] for run in runs), default=0.0) * FIRST_RUN_FACTOR


def run(setup: peers.Setup, seeds: list[int], target: float, deadline_s: float,
        save: Callable[[dict], None]) -> dict:
    """Ours for every seed, then the peer for every seed, each while it fits the deadline."""
    started = time.monotonic()
    root = peers.imagefolder_root(setup)
    report = {**peers.new_report(setup, root, target), "deadline_s": deadline_s,
              "not_run": []}
    for trainer in TRAINERS:
        for seed in seeds:
            left = deadline_s - EXIT_S - (time.monotonic() - started)
            expected = expected_s(trainer, report["runs"])
            if deadline_s and expected > left:
                report["not_run"].append({"trainer": trainer, "seed": seed,
                                          "expected_s": expected, "left_s": max(0.0, left)})
                save(report)
                continue
            peers.record(report, peers.run_one(trainer, setup, seed, root, target), TRAINERS,
                         save)
    return report


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    save = saver(args.json)
    copy = Path(args.copy).resolve()
    why = missing(copy)
    if why:
        save({"skipped": why})
        print(f"imagenette: skipped: {why}")
        return 0
    os.environ["IMAGENETTE_ROOT"] = str(copy)  # the catalog's imagenette_local, here and in runs
    report = run(setup_of(args), [int(seed) for seed in args.seeds.split(",") if seed],
                 args.target, args.deadline, save)
    print(peers.format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))

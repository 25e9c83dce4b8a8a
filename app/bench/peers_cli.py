"""`bin/bench.py peers`: its flags, and the run they ask for (app/bench/peers.py measures it)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from app.bench.peers import TRAINERS, Setup


def add_peers(commands: argparse._SubParsersAction, shared: Callable[..., None]) -> None:
    """`shared`: cli.py's helper for the flags sub-commands share (cli.py imports this module)."""
    peers = commands.add_parser("peers", help="the same training by ours, pytorch/examples' "
                                "main.py recipe, timm's train.py and fastai (the Imagenette "
                                "row's holder's recipe) on the same photos: top-1, wall time "
                                "and train images/s per seed, mean and spread")
    shared(peers, catalog="datasets.toml", dataset=("imagenette_local", "an imagefolder entry "
                                                    "on local disk (the peers read its folders)"))
    peers.add_argument("--config", default="configs/imagenette_cpu.toml", help="our recipe")
    shared(peers, arch=("resnet18", "a name torchvision and timm both know, or ours alone with "
                        "--peer-arch"))
    peers.add_argument("--peer-arch", default="", help="the peers' model when ours is one "
                       "torchvision lacks (e.g. -a resnet50d --peer-arch resnet50)")
    shared(peers, image_size=64, batch_size=64, epochs=5, workers=(2, "loader processes, each"))
    peers.add_argument("--seeds", default="0,1")
    peers.add_argument("--trainers", default=",".join(TRAINERS), help="the first is the "
                       "baseline of the wall-time ratios")
    peers.add_argument("--timm-train", default="", help="train.py of a pytorch-image-models "
                       "checkout (git clone https://github.com/huggingface/pytorch-image-models)"
                       "; needed for the timm trainer")
    peers.add_argument("--device", default="cpu", help="cpu, or cuda:0: each trainer on one "
                       "GPU (timm's train.py with --amp --channels-last, as its README runs)")
    peers.add_argument("--target", type=float, default=0.0, help="a top-1 (e.g. 0.8577, the "
                       "leaderboard's 128 px 5 epochs): also the time each run takes to reach it")
    peers.add_argument("--peer-recipe", choices=("own", "ours"), default="own",
                       help="own: each peer runs its own default recipe (what its users get); "
                       "ours: timm's train.py runs our config's recipe (schedule, LR, "
                       "smoothing, decay, augmentation), so that only the trainer differs")
    peers.add_argument("--ours-args", default="", help="more of the driver's flags for ours, "
                       "in one string (a variant of the config's recipe, e.g. "
                       "\"--mean 0,0,0 --std 1,1,1\")")
    peers.add_argument("--json", help="also write the report to this file, after each run")


def peers_run(args: argparse.Namespace, error: Callable[[str], None]
              ) -> tuple[Setup, list[str], list[int], float]:
    """(setup, trainers, seeds, target) from the flags; `error` (the parser's) for a mistake."""
    trainers = [name for name in args.trainers.split(",") if name]
    if not trainers or set(trainers) - set(TRAINERS):
        error(f"--trainers: known: {', '.join(TRAINERS)}")
    if "timm" in trainers and not Path(args.timm_train).is_file():
        error("--timm-train: give train.py of a pytorch-image-models checkout, or leave timm "
              "out of --trainers")
    setup = Setup(args.catalog, args.dataset, args.config, args.arch, args.image_size,
                  args.batch_size, args.epochs, args.workers,
                  str(Path(args.timm_train).resolve()) if args.timm_train else "", args.device,
                  args.peer_arch, args.peer_recipe, args.ours_args)
    return setup, trainers, [int(seed) for seed in args.seeds.split(",") if seed], args.target

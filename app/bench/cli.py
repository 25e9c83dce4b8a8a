"""bin/bench.py: sub-commands, each printing images/s beside a baseline measured in the same
run (and writing a JSON report with --json / --out)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

from app.bench.gpu_check_cli import add_gpu_check
from app.bench.peers_cli import add_peers, peers_run
from app.config import AugmentConfig, OptimConfig
from app.runtime.files import write_atomically

EXAMPLES = """examples:
  python bin/bench.py e2e --dataset sample_bench -a resnet50 -b 256 -j 8   # training from JPEGs
  python bin/bench.py model -a resnet50 -b 256                   # model only, ours vs the peer
  python bin/bench.py model -a resnet50 -b 256 --random-erase 0.25 --mixup-alpha 0.2 \
      --cutmix-alpha 1.0                                         # + batch augmentations
  python bin/bench.py sync -a resnet50 -b 16 --devices cpu,cpu   # gradient sync modes
  python bin/bench.py loader --dataset sample_bench --dataset imagenet_s3 -j 8  # s3fs, obstore
  python bin/bench.py loader --dataset sample_bench --decoders pillow,dali --auto-augment ta_wide
  python bin/bench.py predict exports/demo --images val/ --limit 256  # ONNX Runtime vs PyTorch
  python3 bin/bench.py gpu-check --out gpu-check   # a GPU machine, proved in 30 minutes
  python bin/bench.py start --workers 1,2,4 -j 1,2 --restart --peer   # what a start costs
  python bin/bench.py peers --dataset imagenette_local --config configs/imagenette_cpu.toml \
      --timm-train ~/pytorch-image-models/train.py --seeds 0,1   # top-1 and wall time, 3 ways
"""


# flags several sub-commands share: option strings, type
SHARED = {"catalog": (("--catalog",), None), "dataset": (("--dataset",), None),
          "arch": (("-a", "--arch"), None), "batch_size": (("-b", "--batch-size"), int),
          "image_size": (("--image-size",), int), "epochs": (("--epochs",), int),
          "workers": (("-j", "--workers"), int), "device": (("--device",), None),
          "steps": (("--steps",), int), "warmup": (("--warmup",), int)}


def shared(sub: argparse.ArgumentParser, **defaults) -> None:
    """SHARED's flags in the order given, with these defaults; (default, help) adds a help."""
    for name, default in defaults.items():
        default, text = default if isinstance(default, tuple) else (default, None)
        flags, kind = SHARED[name]
        sub.add_argument(*flags, type=kind, default=default, help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    e2e = commands.add_parser("e2e", help="training from JPEG files: ours vs the pytorch/examples "
                              "recipe, and as a share of model-only speed")
    shared(e2e, catalog="datasets.toml", dataset="sample_bench", arch="resnet50", batch_size=256,
           image_size=224, workers=(8, "loader processes, both sides"), device="cuda")
    e2e.add_argument("--decoders", "--decoder", default="auto", help="comma-separated "
                     "input pipelines to measure one after the other (auto, dali, nvjpeg, "
                     "pillow), e.g. nvjpeg,pillow,dali; dali is skipped where it does not "
                     "import")
    e2e.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    shared(e2e, steps=50, warmup=10)
    model = commands.add_parser("model", help="model-only images/s: ours vs the peer's numerics")
    shared(model, arch="resnet50", batch_size=256, image_size=224, device="cuda", steps=50,
           warmup=5)
    model.add_argument("--no-compile", action="store_true", help="skip the compiled setting")
    model.add_argument("--no-peer", action="store_true", help="skip the pytorch/examples "
                       "setting (its fp32 cuDNN autotuning takes tens of seconds on a GPU)")
    model.add_argument("--optimizers", default="", help="also measure our first setting's "
                       "step with these comma-separated optimizers (sgd, lars, lamb: built as "
                       "training builds them), e.g. sgd,lars,lamb")
    model.add_argument("--clip-grad-norm", type=float, default=0.0, help="with --optimizers: "
                       "also clip the gradients to this norm (another row each)")
    model.add_argument("--model-ema-steps", type=int, default=0, help="also measure our first "
                       "setting's step with the weights' EMA updated every N steps (32: "
                       "torchvision's recipe)")
    model.add_argument("--sizes", default="", help="also measure our first setting at these "
                       "comma-separated image sizes (e.g. 160,192,224: what progressive "
                       "resizing buys), each against the largest")
    model.add_argument("--batch-sizes", default="", help="... and at these comma-separated "
                       "batch sizes (e.g. 256,512; default: -b)")
    model.add_argument("--optimizer-steps", default="", help="... and with these "
                       "comma-separated implementations of the SGD step: default, foreach, "
                       "fused (e.g. foreach,fused), each against the first")
    for flag, what in (("--random-erase", "random erasing probability"),
                       ("--mixup-alpha", "mixup alpha"), ("--cutmix-alpha", "cutmix alpha")):
        model.add_argument(flag, type=float, default=0.0, help=f"{what}: also measure our "
                           "settings with the batch augmentations, and them alone")
    sync = commands.add_parser("sync", help="step time: 1 worker vs N workers ps vs allreduce")
    shared(sync, arch="resnet50", batch_size=(16, "per worker"), image_size=64)
    sync.add_argument("--devices", default="cpu,cpu", help="worker devices, e.g. cuda:0,cuda:1")
    shared(sync, steps=10, warmup=3)
    sync.add_argument("--bucket-mb", type=float, default=25.0)
    sync.add_argument("--modes", default="local,ps,allreduce", help="which to measure: local "
                      "(1 worker, no sync), ps, allreduce")
    sync.add_argument("--compile-backend", default="inductor", help="e.g. aot_eager: "
                      "traces and differentiates, generates no code")
    sync.add_argument("--compile", default="off", choices=("off", "whole", "regions"),
                      help="torch.compile the model whole or by regions (each block of the stages)")
    loader = commands.add_parser("loader", help="loader-only images/s of one or more datasets")
    loader.add_argument("--catalog", default="datasets.toml")
    loader.add_argument("--dataset", action="append", required=True,
                        help="repeat to compare datasets; ratios are to the first")
    shared(loader, batch_size=64, workers=4, image_size=224)
    loader.add_argument("--batches", type=int, default=20)
    loader.add_argument("--readers", default="s3fs,obstore",
                        help="readers to compare on object-store datasets, the baseline first")
    loader.add_argument("--decoders", default="pillow", help="input pipelines to compare, "
                        "e.g. pillow,dali")
    loader.add_argument("--device", default="cpu", help="where batches are delivered (cuda: "
                        "DALI decodes on the GPU)")
    loader.add_argument("--auto-augment", default="", help="also measure these auto-augment "
                        "policies, e.g. ta_wide or ta_wide,ra,imagenet: a row each beside the "
                        "plain one, per decoder")
    loader.add_argument("--no-peer", action="store_true", help="skip the pytorch/examples "
                        "loader baseline")
    guess = commands.add_parser("predict", help="predict images/s: an export's model.onnx in "
                                "ONNX Runtime vs our PyTorch model, same images")
    guess.add_argument("model", nargs="?", default="", metavar="EXPORT_DIR",
                       help="an export folder with model.onnx (or give -a)")
    guess.add_argument("--images", action="append", required=True,
                       help="an image or a folder of them; repeat for more")
    shared(guess, arch=("", "instead of EXPORT_DIR: export a freshly initialised model of "
                        "this name"), image_size=(224, "with -a: the crop size"), batch_size=32)
    guess.add_argument("--repeats", type=int, default=3, help="passes; the best one counts")
    guess.add_argument("--limit", type=int, default=0, help="at most this many images")
    add_gpu_check(commands)
    start = commands.add_parser("start", help="what starting a run costs: the machine's CPU "
                                "seconds and the time to the first step, N workers, a restart, "
                                "and pytorch/examples' main.py beside them")
    shared(start, dataset="sample_tiny", arch=("resnet18", "a torchvision model name too, "
                                                "with --peer"),
           image_size=32, batch_size=(16, "per worker process"), epochs=1)
    start.add_argument("--device", default="cpu", help="every worker's: cpu, or cuda:0 (the "
                       "workers share it; no --peer then)")
    start.add_argument("--workers", default="1,2,4", help="worker processes, comma-separated")
    start.add_argument("--sync", default="ps,allreduce", help="modes for 2+ workers")
    start.add_argument("-j", "--loaders", default="1,2", help="loader processes per worker")
    start.add_argument("--restart", action="store_true", help="also: SIGKILL worker 1 of 2 "
                       "after its first step, time to the first step of the restarted group")
    start.add_argument("--peer", action="store_true", help="also: pytorch/examples' main.py "
                       "recipe with as many processes and loader processes")
    start.add_argument("--repeats", type=int, default=2)
    start.add_argument("--baseline-repo", help="another checkout of this project, measured in "
                       "the same run (each of its rows right after ours)")
    add_peers(commands, shared)
    for sub in (e2e, model, sync, loader, guess, start):
        sub.add_argument("--json", help="also write the report to this file")
    return parser


def recipe_optimizers(names: str, clip: float) -> list[OptimConfig]:
    """One row per optimizer, and one more per optimizer with clipping when asked for."""
    optimizers = [OptimConfig(optimizer=name) for name in names.split(",") if name]
    return optimizers + [dataclasses.replace(o, clip_grad_norm=clip)
                         for o in optimizers if clip]


def names_in(flag: str, text: str, known, required: bool = False) -> list[str]:
    """The comma-separated names of `text`, each one of `known` (else the parser's error)."""
    names = [name for name in text.split(",") if name]
    unknown = set(names) - set(known)
    if unknown or (required and not names):
        build_parser().error(f"{flag}: unknown {', '.join(sorted(unknown)) or 'nothing'}; "
                             f"known: {', '.join(known)}")
    return names


def numbers(text: str) -> list[int]:
    return [int(value) for value in text.split(",") if value]


def saver(path: str | None) -> Callable[[dict], None]:
    """Writes a report so far to --json, whole, after each of its rows: a run cut short (a
    gpu-check part at its deadline) keeps the rows that finished."""
    if not path:
        return lambda report: None
    return lambda report: write_atomically(path, json.dumps(report, indent=2))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    save = saver(getattr(args, "json", None))
    code = 0
    # torch-heavy modules load after parsing, so --help and mistakes answer at once
    if args.command == "e2e":
        from app.bench import e2e as bench  # noqa: PLC0415
        from app.data.decoders import DECODERS  # noqa: PLC0415
        decoders = names_in("--decoders", args.decoders, ("auto", *DECODERS), required=True)
        report = bench.run(bench.Setup(args.catalog, args.dataset, args.arch, args.batch_size,
                                       args.image_size, args.workers, args.device, args.steps,
                                       args.warmup, tuple(decoders), args.compile), save)
    elif args.command == "model":
        from app.bench import model as bench  # noqa: PLC0415
        settings = [bench.OURS_EAGER] if args.no_compile else [bench.OURS, bench.OURS_EAGER]
        settings += [] if args.no_peer else [bench.PEER]
        augment = AugmentConfig(random_erase=args.random_erase, mixup_alpha=args.mixup_alpha,
                                cutmix_alpha=args.cutmix_alpha)
        report = bench.run(args.arch, args.batch_size, args.image_size, args.device,
                           args.steps, args.warmup, settings,
                           augment if augment != AugmentConfig() else None,
                           numbers(args.sizes),
                           recipe_optimizers(args.optimizers, args.clip_grad_norm),
                           args.model_ema_steps, numbers(args.batch_sizes),
                           names_in("--optimizer-steps", args.optimizer_steps,
                                    bench.OPTIMIZER_STEPS), save)
    elif args.command == "sync":
        from app.bench import sync as bench  # noqa: PLC0415
        if not set(args.modes.split(",")) <= set(bench.MODES):
            build_parser().error(f"--modes: known: {', '.join(bench.MODES)}")
        report = bench.run(args.arch, args.batch_size, args.image_size, args.devices.split(","),
                           args.steps, args.warmup, args.bucket_mb, args.compile,
                           args.compile_backend, tuple(args.modes.split(",")), save)
    elif args.command == "loader":
        from app.bench import loader as bench  # noqa: PLC0415
        from app.data.auto_augment import AUTO_AUGMENT  # noqa: PLC0415
        augments = names_in("--auto-augment", args.auto_augment, AUTO_AUGMENT)
        report = bench.run(args.catalog, args.dataset, args.image_size, args.batch_size,
                           args.workers, args.batches, tuple(args.readers.split(",")),
                           tuple(args.decoders.split(",")), args.device, not args.no_peer,
                           tuple(augments))
    elif args.command == "predict":
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bin/predict.py: before torch
        from app.bench import predict as bench  # noqa: PLC0415
        if bool(args.model) == bool(args.arch):
            build_parser().error("predict: give EXPORT_DIR or -a ARCH (one of them)")
        report = bench.run(args.model, args.arch, args.image_size, args.images,
                           args.batch_size, args.repeats, args.limit)
    elif args.command == "start":
        from app.bench import start as bench  # noqa: PLC0415
        if args.peer and args.device != "cpu":
            build_parser().error("start: --peer runs on CPU processes only (gloo)")
        setup = bench.Setup(args.dataset, args.arch, args.image_size, args.batch_size,
                            args.epochs, args.device)
        rows = bench.rows_for(numbers(args.workers), args.sync.split(","),
                              numbers(args.loaders), args.restart, args.peer)
        report = bench.run(setup, rows, args.repeats,
                           Path(args.baseline_repo).resolve() if args.baseline_repo else None,
                           save)
    elif args.command == "peers":
        from app.bench import peers as bench  # noqa: PLC0415
        report = bench.run(*peers_run(args, build_parser().error), save)
    else:
        from app.bench import gpu_check as bench  # noqa: PLC0415
        options = bench.Options(args.test_processes, args.select, args.dali_threads,
                                args.dali_batch, args.dali_sample)
        try:
            parts = bench.chosen(args.parts, args.budget, options)
        except ValueError as error:
            build_parser().error(f"--parts: {error}")
        if args.list:
            print(bench.format_plan(parts))
            return 0
        report, code = bench.run(parts, args.budget, Path(args.out), Path(args.work),
                                 Path(args.archive) if args.archive else None)
    print(bench.format_report(report))
    save(report)
    return code

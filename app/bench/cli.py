"""bin/bench.py: sub-commands, each printing images/s beside a baseline measured in the same
run (and writing a JSON report with --json / --out)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

from app.bench import reports
from app.bench.gpu_check import BUDGET_S, WORK
from app.bench.part_runner import DEADLINE_ENV
from app.bench.peers import TRAINERS, Setup
from app.config import AugmentConfig, OptimConfig
from app.runtime.files import write_atomically

EXAMPLES = r"""examples:
  python bin/bench.py e2e --dataset sample_bench -a resnet50 -b 256 -j 8   # training from JPEGs
  python bin/bench.py model -a resnet50 -b 256 --sizes 160,192,224   # model only, vs the peer
  python bin/bench.py sync -a resnet50 -b 16 --devices cpu,cpu   # gradient sync modes
  python bin/bench.py loader --dataset sample_bench --decoders pillow,dali --auto-augment ta_wide
  python bin/bench.py predict exports/demo --images val/ --limit 256  # ONNX Runtime vs PyTorch
  python bin/bench.py start --workers 1,2,4 -j 1,2 --restart --peer   # what a start costs
  python bin/bench.py peers --dataset imagenette_local --config configs/imagenette_cpu.toml \
      --timm-train ~/pytorch-image-models/train.py --seeds 0,1   # top-1 and wall time, 3 ways
  python3 bin/bench.py gpu-check --out gpu-check   # a GPU box proved, in 30 minutes
"""

def flag(*names: str, **options) -> tuple[tuple[str, ...], dict]:
    return names, options


# the flags several commands share
NAMES = {"catalog": ("--catalog",), "dataset": ("--dataset",), "arch": ("-a", "--arch"),
         "batch_size": ("-b", "--batch-size"), "image_size": ("--image-size",),
         "epochs": ("--epochs",), "workers": ("-j", "--workers"), "device": ("--device",),
         "steps": ("--steps",), "warmup": ("--warmup",)}
JSON = flag("--json", help="also write the report to this file, after each row (run)")


def shared(**defaults) -> list[tuple]:
    """NAMES' flags with these defaults, an int default making an int flag; (default, help)
    adds a help."""
    found = []
    for name, default in defaults.items():
        default, text = default if isinstance(default, tuple) else (default, None)
        found.append(flag(*NAMES[name], default=default, help=text,
                          type=int if isinstance(default, int) else None))
    return found


AUGMENTS = (("random-erase", "random erasing probability"), ("mixup-alpha", "mixup alpha"),
            ("cutmix-alpha", "cutmix alpha"))
COMMANDS: dict[str, tuple[str, list[tuple]]] = {
    "e2e": ("training from JPEG files: ours vs the pytorch/examples recipe, and as a share of "
            "model-only speed", [
        *shared(catalog="datasets.toml", dataset="sample_bench", arch="resnet50",
                batch_size=256, image_size=224, workers=(8, "loader processes, both sides"),
                device="cuda", steps=50, warmup=10),
        flag("--decoders", "--decoder", default="auto", help="input pipelines, one after the "
             "other: e.g. nvjpeg,pillow,dali (dali skipped where it does not import)"),
        flag("--compile", default="auto", choices=("auto", "on", "off")), JSON]),
    "model": ("model-only images/s: ours vs the peer's numerics", [
        *shared(arch="resnet50", batch_size=256, image_size=224, device="cuda", steps=50,
                warmup=5),
        flag("--no-compile", action="store_true", help="skip the compiled setting"),
        flag("--no-peer", action="store_true", help="skip the pytorch/examples setting"),
        flag("--optimizers", default="", help="also our first setting's step with these "
             "optimizers, built as training builds them: e.g. sgd,lars,lamb"),
        flag("--clip-grad-norm", type=float, default=0.0, help="with --optimizers: a row "
             "each with the gradients clipped to this norm"),
        flag("--model-ema-steps", type=int, default=0, help="also our first setting's step "
             "with the weights' EMA every N steps (torchvision's: 32)"),
        flag("--sizes", default="", help="also our first setting at these image sizes, each "
             "against the largest: e.g. 160,192,224 (what progressive resizing buys)"),
        *(flag(f"--{name}", type=float, default=0.0, help=f"{what}: also our settings with "
               "the batch augmentations, and them alone") for name, what in AUGMENTS), JSON]),
    "sync": ("step time: 1 worker vs N workers ps vs allreduce", [
        *shared(arch="resnet50", batch_size=(16, "per worker"), image_size=64, steps=10,
                warmup=3),
        flag("--devices", default="cpu,cpu", help="worker devices, e.g. cuda:0,cuda:1"),
        flag("--bucket-mb", type=float, default=25.0),
        flag("--modes", default="local,ps,allreduce", help="local: 1 worker, no sync"),
        flag("--compile", default="off", choices=("off", "whole", "regions"),
             help="the model compiled whole or by regions (each block of the stages)"),
        flag("--compile-backend", default="inductor", help="e.g. aot_eager: no code made"),
        JSON]),
    "loader": ("loader-only images/s of one or more datasets", [
        flag("--catalog", default="datasets.toml"),
        flag("--dataset", action="append", required=True, help="repeat to compare datasets; "
             "ratios are to the first"),
        *shared(batch_size=64, workers=4, image_size=224),
        flag("--batches", type=int, default=20),
        flag("--readers", default="s3fs,obstore", help="on an object store, the baseline "
             "first"),
        flag("--decoders", default="pillow", help="input pipelines to compare: pillow,dali"),
        flag("--device", default="cpu", help="where batches go (cuda: DALI decodes on it)"),
        flag("--auto-augment", default="", help="also these auto-augment policies, e.g. "
             "ta_wide,ra,imagenet: a row each beside the plain one, per decoder"),
        flag("--no-peer", action="store_true", help="skip the pytorch/examples loader"), JSON]),
    "predict": ("predict images/s: an export's model.onnx in ONNX Runtime vs our PyTorch "
                "model, same images", [
        flag("model", nargs="?", default="", metavar="EXPORT_DIR", help="an export folder "
             "with model.onnx (or give -a)"),
        flag("--images", action="append", required=True, help="an image or a folder of them; "
             "repeat for more"),
        *shared(arch=("", "instead of EXPORT_DIR: a fresh model of this name, exported"),
                image_size=(224, "with -a: the crop size"), batch_size=32),
        flag("--repeats", type=int, default=3, help="passes; the best one counts"),
        flag("--limit", type=int, default=0, help="at most this many images"), JSON]),
    "start": ("what starting a run costs: the machine's CPU seconds and the time to the first "
              "step, N workers, a restart, and pytorch/examples' main.py beside them", [
        *shared(dataset="sample_tiny", arch=("resnet18", "torchvision's too, with --peer"),
                image_size=32, batch_size=(16, "per worker process"), epochs=1),
        flag("--device", default="cpu", help="every worker's: cpu, or cuda:0 (no --peer)"),
        flag("--workers", default="1,2,4", help="worker processes, comma-separated"),
        flag("--sync", default="ps,allreduce", help="modes for 2+ workers"),
        flag("-j", "--loaders", default="1,2", help="loader processes per worker"),
        flag("--restart", action="store_true", help="also: SIGKILL worker 1 of 2 after its "
             "first step, time to the first step of the restarted group"),
        flag("--peer", action="store_true", help="also: pytorch/examples' main.py recipe, as "
             "many processes and loader processes"),
        flag("--repeats", type=int, default=2), JSON]),
    "peers": ("the same training by ours, pytorch/examples' main.py recipe, timm's train.py "
              "and fastai (the Imagenette row's holder's recipe) on the same photos: top-1, "
              "wall time and train images/s per seed, mean and spread", [
        *shared(catalog="datasets.toml", dataset=("imagenette_local", "an imagefolder on "
                                                  "local disk (the peers read its folders)")),
        flag("--config", default="configs/imagenette_cpu.toml", help="our recipe"),
        *shared(arch=("resnet18", "torchvision's and timm's, or ours with --peer-arch")),
        flag("--peer-arch", default="", help="the peers' model where torchvision lacks ours "
             "(e.g. -a resnet50d --peer-arch resnet50)"),
        *shared(image_size=64, batch_size=64, epochs=5, workers=(2, "loader processes, each")),
        flag("--seeds", default="0,1"),
        flag("--trainers", default=",".join(TRAINERS), help="the first: the wall's baseline"),
        flag("--timm-train", default="", help="the timm trainer's train.py, of a checkout of "
             "https://github.com/huggingface/pytorch-image-models"),
        flag("--device", default="cpu", help="cpu, or cuda:0: each trainer on one GPU (timm's "
             "train.py with --amp --channels-last, as its README runs)"),
        flag("--peer-recipe", choices=("own", "ours"), default="own", help="own: each peer "
             "its default recipe; ours: timm's train.py runs our config's, so that only the "
             "trainer differs"),
        flag("--ours-args", default="", help="more driver flags for ours, in one string: e.g. "
             "\"--mean 0,0,0 --std 1,1,1\""),
        flag("--deadline", type=float, default=float(os.environ.get(DEADLINE_ENV, 0)),
             help="seconds: the first trainer's seeds first, and only runs expected to end "
             "within them (default: a gpu-check part's own; 0: none)"), JSON]),
    "gpu-check": ("prove a GPU box end to end within a time budget (a new machine, a cloud "
                  "image, a driver upgrade): parts in their order of value, each with its own "
                  "deadline, each report written the moment it ends", [
        flag("--budget", type=float, default=BUDGET_S, help="seconds for all the parts "
             f"(default {BUDGET_S:.0f}: each its whole deadline, the gpu tests about 15 min; "
             "from 600 the parts up to the gpu tests keep theirs, the rest goes to the tests)"),
        flag("--out", default="gpu-check", help="the reports: <part>.json, <part>.log, summary.md"),
        flag("--work", default=str(WORK), help="compile caches, samples, run folders"),
        flag("--archive", help="also pack the report folder into this .tar.gz after each part"),
        flag("--parts", default="", help="only these, comma-separated (--list names them)"),
        flag("--list", action="store_true", help="the parts and their deadlines, run nothing"),
        flag("-n", "--test-processes", type=int, default=4, help="gpu test processes sharing "
             "the GPU (needs pytest-xdist)"),
        flag("-k", "--select", default="", help="only the gpu tests matching this -k"),
        flag("--dali-threads", type=int, default=8, help="threads (-j) of the DALI pipelines "
             "measured"),
        flag("--dali-batch", type=int, default=256, help="their batch size"),
        flag("--dali-sample", default="tiny", choices=("tiny", "bench"), help="the sample they "
             "read (bench: ImageNet-sized images, which the first batch's memory depends on)")]),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (text, flags) in COMMANDS.items():
        sub = commands.add_parser(name, help=text)
        for names, options in flags:
            sub.add_argument(*names, **options)
    return parser


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


def setup_from(kind, args: argparse.Namespace, **given):
    """A dataclass of `kind` from the flags of its fields' names (its defaults for the
    others), `given` over them."""
    return kind(**{**{field.name: getattr(args, field.name)
                      for field in dataclasses.fields(kind) if hasattr(args, field.name)},
                   **given})


def peers_run(args: argparse.Namespace) -> tuple[Setup, list[str], list[int]]:
    """(setup, trainers, seeds) from peers' flags, a mistake the parser's error."""
    trainers = names_in("--trainers", args.trainers, TRAINERS, required=True)
    if "timm" in trainers and not Path(args.timm_train).is_file():
        build_parser().error("--timm-train: give train.py of a pytorch-image-models checkout, "
                             "or leave timm out of --trainers")
    setup = setup_from(Setup, args, timm_train=str(Path(args.timm_train).resolve())
                       if args.timm_train else "")
    return setup, trainers, numbers(args.seeds)


# Each command's run from its flags, to its report (read by reports.<command>); torch-heavy
# modules load here, after parsing, so that --help and mistakes answer at once.
def e2e(args: argparse.Namespace, save: Callable[[dict], None]):
    from app.bench import loader as bench  # noqa: PLC0415
    from app.data.decoders import DECODERS  # noqa: PLC0415
    decoders = names_in("--decoders", args.decoders, ("auto", *DECODERS), required=True)
    return bench.run_e2e(setup_from(bench.E2ESetup, args, decoders=tuple(decoders)), save)


def model(args: argparse.Namespace, save: Callable[[dict], None]):
    from app.bench import model as bench  # noqa: PLC0415
    settings = [bench.OURS_EAGER] if args.no_compile else [bench.OURS, bench.OURS_EAGER]
    augment = setup_from(AugmentConfig, args)  # its batch augmentations' flags
    # one row per optimizer, and one more per optimizer with clipping when asked for
    optimizers = [OptimConfig(optimizer=name) for name in args.optimizers.split(",") if name]
    optimizers += [dataclasses.replace(o, clip_grad_norm=args.clip_grad_norm)
                   for o in optimizers if args.clip_grad_norm]
    return bench.run(
        args.arch, args.batch_size, args.image_size, args.device, args.steps, args.warmup,
        settings + ([] if args.no_peer else [bench.PEER]),
        augment if augment != AugmentConfig() else None, numbers(args.sizes), optimizers,
        args.model_ema_steps, save)


def sync(args: argparse.Namespace, save: Callable[[dict], None]):
    from app.bench import model as bench  # noqa: PLC0415
    modes = names_in("--modes", args.modes, bench.SYNC_MODES)
    return bench.run_sync(args.arch, args.batch_size, args.image_size,
                          args.devices.split(","), args.steps, args.warmup, args.bucket_mb,
                          args.compile, args.compile_backend, tuple(modes), save)


def loader(args: argparse.Namespace, save: Callable[[dict], None]):
    from app.bench import loader as bench  # noqa: PLC0415
    from app.data.auto_augment import AUTO_AUGMENT  # noqa: PLC0415
    augments = names_in("--auto-augment", args.auto_augment, AUTO_AUGMENT)
    return bench.run_loader(args.catalog, args.dataset, args.image_size, args.batch_size,
                            args.workers, args.batches, tuple(args.readers.split(",")),
                            tuple(args.decoders.split(",")), args.device, not args.no_peer,
                            tuple(augments))


def predict(args: argparse.Namespace, save: Callable[[dict], None]):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bin/predict.py: before torch
    from app.bench import predict as bench  # noqa: PLC0415
    if bool(args.model) == bool(args.arch):
        build_parser().error("predict: give EXPORT_DIR or -a ARCH (one of them)")
    return bench.run(args.model, args.arch, args.image_size, args.images, args.batch_size,
                     args.repeats, args.limit)


def start(args: argparse.Namespace, save: Callable[[dict], None]):
    from app.bench import start as bench  # noqa: PLC0415
    if args.peer and args.device != "cpu":
        build_parser().error("start: --peer runs on CPU processes only (gloo)")
    setup = setup_from(bench.Setup, args)
    rows = bench.rows_for(numbers(args.workers), args.sync.split(","), numbers(args.loaders),
                          args.restart, args.peer)
    return bench.run(setup, rows, args.repeats, save)


def peers(args: argparse.Namespace, save: Callable[[dict], None]):
    from app.bench import peers as bench  # noqa: PLC0415
    return bench.run(*peers_run(args), save, args.deadline)


def gpu_check(args: argparse.Namespace, save: Callable[[dict], None]):
    from app.bench import gpu_check as bench  # noqa: PLC0415
    try:
        parts = bench.chosen(args.parts, args.budget, setup_from(bench.Options, args))
    except ValueError as error:
        build_parser().error(f"--parts: {error}")
    if args.list:  # the plan
        print("\n".join(f"{p.name:<16}{p.deadline_s:>6.0f} s  {p.what}" + (
            f" ({p.reserved_s:.0f} s reserved)" if p.reserved_s else "") for p in parts))
        return None
    return bench.run(parts, args.budget, Path(args.out), Path(args.work),
                     Path(args.archive) if args.archive else None)


RUNS = {"e2e": e2e, "model": model, "sync": sync, "loader": loader, "predict": predict,
        "start": start, "peers": peers, "gpu-check": gpu_check}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    save = saver(getattr(args, "json", None))
    report = RUNS[args.command](args, save)
    if report is None:  # gpu-check --list printed the plan
        return 0
    print("\n".join(getattr(reports, args.command.replace("-", "_"))(report)))
    save(report)
    return report.get("exit_code", 0)

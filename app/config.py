"""The run configuration: one typed dataclass tree, filled from defaults, a TOML file and flags.

Every parameter is declared once (type, default, help, optional short flags); the TOML sections
and the command line are two ways to fill the same tree. Precedence: flags > file > defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from app.errors import UserError
from app.tomlfile import read_toml


def param(default, help: str, *flags: str, choices: tuple | None = None):
    """One declared parameter: default, help text, optional pytorch/examples-style flags."""
    metadata = {"help": help, "flags": flags, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(kw_only=True)
class DataConfig:
    dataset: str = param("", "dataset name in the catalog (default: the catalog's `default`)", "--dataset")
    catalog: str = param("datasets.toml", "path of the dataset catalog (relative: to the "
                         "current folder, else to the project folder)", "--catalog")
    classes: int | list[str] = param(
        0, "class subset: a count (first N of the synset mapping) or comma-separated wnids; 0 = all",
        "--classes")
    image_size: int = param(
        0, "train/val crop size in pixels; 0 = the dataset's image_size, else 224", "--image-size")
    train_index: str = param(
        "cls", "train image list: cls = ImageSets/CLS-LOC/train_cls.txt (all images), "
        "csv = LOC_train_solution.csv (boxed images only, ~42%%), listing = directory listing",
        "--train-index", choices=("cls", "csv", "listing"))
    workers: int = param(4, "data loading processes per device", "-j", "--workers")
    max_bad_fraction: float = param(
        0.01, "stop when more than this share of an epoch's images cannot be read or decoded "
        "(they are skipped and listed in skipped.tsv)", "--max-bad-fraction")


@dataclass(kw_only=True)
class ModelConfig:
    arch: str = param(
        "resnet34", "model name: any timm name (resnet18/34/50/101/152, ...) or resnet18_small "
        "(3x3 stem, no max-pool, for low-resolution images)", "-a", "--arch")
    norm: str = param("batch", "normalisation layers: batch (BatchNorm) or group (GroupNorm, "
                      "independent of the batch split)", "--norm", choices=("batch", "group"))


@dataclass(kw_only=True)
class OptimConfig:
    optimizer: str = param("sgd", "optimizer", "--optimizer", choices=("sgd", "adamw"))
    lr: float = param(0.1, "learning rate per 256 images; scaled by the global batch size", "--lr")
    momentum: float = param(0.9, "SGD momentum (AdamW: beta1)", "--momentum")
    nesterov: bool = param(False, "Nesterov momentum for SGD", "--nesterov")
    weight_decay: float = param(
        1e-4, "weight decay (not applied to normalisation and bias parameters)",
        "--wd", "--weight-decay")
    label_smoothing: float = param(0.0, "label smoothing of the cross-entropy loss", "--label-smoothing")
    schedule: str = param("cosine", "LR schedule after warmup", "--schedule", choices=("cosine", "step"))
    warmup_epochs: float = param(5.0, "linear warmup length in epochs", "--warmup-epochs")
    step_epochs: int = param(30, "step schedule: decay every N epochs", "--step-epochs")
    step_gamma: float = param(0.1, "step schedule: decay factor", "--step-gamma")


@dataclass(kw_only=True)
class TrainConfig:
    epochs: int = param(90, "number of full passes over the train set", "--epochs")
    batch_size: int = param(
        256, "batch size PER DEVICE; the global batch is this times the number of devices",
        "-b", "--batch-size")
    seed: int = param(0, "seed for weights, data order and augmentation", "--seed")
    print_freq: int = param(10, "log train metrics every N steps", "-p", "--print-freq")
    device: str = param("auto", "device: auto (cuda if present), cpu, cuda, cuda:N", "--device")
    amp: str = param(
        "auto", "mixed precision: auto = bf16 on CUDA, off on CPU", "--amp",
        choices=("auto", "bf16", "fp16", "off"))
    channels_last: bool = param(True, "channels_last memory format on CUDA", "--channels-last")
    dtype: str = param("float32", "parameter dtype; float64 is for numerical checks",
                       "--dtype", choices=("float32", "float64"))


@dataclass(kw_only=True)
class ParallelConfig:
    gpus: int = param(0, "train on this many GPUs (cuda:0..N-1), one worker process each",
                      "--gpus")
    devices: list[str] = param(
        [], "explicit worker devices, repeats allowed: cuda:0,cuda:1 or cpu,cpu", "--devices")
    sync: str = param(
        "auto", "gradient sync: ps = parameter server (one machine), allreduce = "
        "torch.distributed DDP (also under torchrun); auto = ps, or allreduce under torchrun",
        "--sync", choices=("auto", "ps", "allreduce"))
    bucket_mb: float = param(25.0, "gradient bucket size in MB (ps and allreduce)", "--bucket-mb")
    check_every: int = param(200, "ps: compare replica weight checksums every N steps",
                             "--check-every")
    timeout_s: float = param(
        1800.0, "give up when a live peer has not answered for this long (seconds)",
        "--sync-timeout")


@dataclass(kw_only=True)
class RunConfig:
    name: str = param("", "run name; outputs go to OUTPUT_DIR/NAME (default: dataset-arch-time)",
                      "--run-name")
    output_dir: str = param("runs", "folder that holds the run folders", "--output-dir")
    resume: str = param("", "checkpoint to resume from, or `auto` = last.pt of this run",
                        "--resume")
    evaluate: bool = param(False, "only evaluate the model (from --resume) on the val set",
                           "-e", "--evaluate")
    checkpoint_interval: float = param(
        0.0, "also save a checkpoint every this many minutes (mid-epoch; 0 = epoch ends only)",
        "--checkpoint-interval")
    keep_checkpoints: int = param(3, "keep the newest N step-*.pt checkpoints (last.pt and "
                                  "best.pt are names of kept files)", "--keep-checkpoints")
    stop_timeout: float = param(
        120.0, "after SIGTERM/SIGINT, wait this many seconds for the checkpoint before killing "
        "the workers (a second signal kills at once)", "--stop-timeout")


@dataclass(kw_only=True)
class LoggingConfig:
    loggers: list[str] = param(
        ["console"], "comma-separated loggers: console, wandb (metrics.jsonl and curves.png are "
        "always written)", "--logger", choices=("console", "wandb", "jsonl"))
    # Empty wandb settings defer to wandb's own environment variables (WANDB_PROJECT, ...).
    wandb_project: str = param("", "wandb project (default: $WANDB_PROJECT, else imagenet-dp)",
                               "--wandb-project")
    wandb_entity: str = param("", "wandb entity, a user or team (default: $WANDB_ENTITY)",
                              "--wandb-entity")
    wandb_mode: str = param("", "wandb mode (default: $WANDB_MODE, else online)",
                            "--wandb-mode", choices=("", "online", "offline", "disabled"))
    wandb_tags: list[str] = param([], "comma-separated wandb tags (default: $WANDB_TAGS)",
                                  "--wandb-tags")
    save_weights_every: int = param(
        0, "log last.pt as a wandb artifact every N epochs; 0 = never", "--save-weights-every")


@dataclass(kw_only=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


# --- coercion: TOML values and flag strings into the declared types -----------------------

def _coerce(value: Any, kind: Any, where: str, choices: tuple | None) -> Any:
    """Check (and for flag strings, convert) one value against its declared type."""
    if isinstance(kind, types.UnionType):  # int | list[str]: try each in order
        for option in typing.get_args(kind):
            try:
                return _coerce(value, option, where, choices)
            except UserError:
                continue
        raise UserError(f"{where}: expected {_describe(kind)}, got {value!r}")
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            value = value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false, got {value!r}")
    elif kind in (int, float):
        if isinstance(value, str):
            try:
                value = kind(value)
            except ValueError:
                pass
        accepted = (int,) if kind is int else (int, float)
        if not isinstance(value, accepted) or isinstance(value, bool):
            raise UserError(f"{where}: expected {_describe(kind)}, got {value!r}")
        value = kind(value)
    elif kind is str:
        if not isinstance(value, str):
            raise UserError(f"{where}: expected a string, got {value!r}")
    elif typing.get_origin(kind) is list:
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise UserError(f"{where}: expected a list of strings, got {value!r}")
    for item in (value if isinstance(value, list) else [value]) if choices else []:
        if item not in choices:
            raise UserError(f"{where}: must be one of {', '.join(choices)}, got {item!r}")
    return value


def _describe(kind: Any) -> str:
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    if isinstance(kind, types.UnionType):
        return " or ".join(_describe(k) for k in typing.get_args(kind))
    return names.get(kind, "a list of strings")


# --- TOML file --------------------------------------------------------------------------

def _overrides_from_file(path: str) -> dict[tuple[str, str], Any]:
    data = read_toml(path, "run config")
    overrides = {}
    sections = _section_types()
    for section, values in data.items():
        if section not in sections:
            raise UserError(f"{path}: unknown section [{section}]; known: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise UserError(f"{path}: `{section}` must be a table ([{section}])")
        known = _field_types(sections[section])
        for key, value in values.items():
            if key not in known:
                raise UserError(f"{path}: unknown key `{section}.{key}`; known in [{section}]: "
                                f"{', '.join(known)}")
            overrides[(section, key)] = value
    return overrides


# --- command line -----------------------------------------------------------------------

def build_parser(prog: str = "driver.py", description: str = "") -> argparse.ArgumentParser:
    """Flags for every declared parameter; defaults are SUPPRESSed so only given flags count."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help="run config (TOML) with sections "
                        + ", ".join(f"[{s}]" for s in SECTIONS))
    for section, section_cls in _section_types().items():
        group = parser.add_argument_group(f"[{section}]")
        for f in dataclasses.fields(section_cls):
            flags = _flags(section, f)
            kind = _field_types(section_cls)[f.name]
            dest = f"{section}.{f.name}"
            help_text = f"{f.metadata['help']} (default: {_default_text(f)})"
            if kind is bool:
                group.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction,
                                   help=help_text)
            else:
                # Lists ("console,wandb") are checked item by item in _coerce, not by argparse.
                choices = None if typing.get_origin(kind) is list else f.metadata["choices"]
                group.add_argument(*flags, dest=dest, metavar=f.name.upper(), choices=choices,
                                   help=help_text)
    return parser


def _flags(section: str, f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["flags"] or (f"--{section}.{f.name}",)


def _default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(value, list):
        return ",".join(value)
    return repr(value) if value == "" else str(value)


def parse_config(argv: list[str] | None = None, *, extra: argparse.ArgumentParser | None = None
                 ) -> tuple[Config, argparse.Namespace]:
    """Defaults, then --config FILE, then flags. Returns the config and the raw namespace
    (entry points may add their own non-config flags through `extra`)."""
    parser = extra or build_parser()
    namespace = parser.parse_args(argv)
    overrides = {}
    source = {}
    if getattr(namespace, "config", None):
        for key, value in _overrides_from_file(namespace.config).items():
            overrides[key] = value
            source[key] = namespace.config
    for dest, value in vars(namespace).items():
        if "." in dest:
            section, key = dest.split(".", 1)
            overrides[(section, key)] = value
            declared = {f.name: f for f in dataclasses.fields(_section_types()[section])}
            source[(section, key)] = "flag " + _flags(section, declared[key])[-1]
    return make_config(overrides, source), namespace


def make_config(overrides: dict[tuple[str, str], Any] | None = None,
                source: dict[tuple[str, str], str] | None = None) -> Config:
    """A Config with `{(section, key): value}` applied and validated."""
    overrides = overrides or {}
    source = source or {}
    sections = _section_types()
    built = {}
    for section, section_cls in sections.items():
        values = {}
        declared = {f.name: f for f in dataclasses.fields(section_cls)}
        kinds = _field_types(section_cls)
        for (sec, key), value in overrides.items():
            if sec != section:
                continue
            if key not in declared:
                raise UserError(f"unknown config key `{section}.{key}`")
            where = f"{source.get((sec, key), 'config')}: {section}.{key}"
            values[key] = _coerce(value, kinds[key], where, declared[key].metadata["choices"])
        built[section] = section_cls(**values)
    for sec in overrides:
        if sec[0] not in sections:
            raise UserError(f"unknown config section [{sec[0]}]")
    config = Config(**built)
    validate(config)
    return config


def validate(config: Config) -> None:
    """Range checks that types alone cannot express."""
    checks = [
        (config.train.epochs >= 1, "train.epochs must be at least 1"),
        (config.train.batch_size >= 1, "train.batch_size must be at least 1"),
        (config.train.print_freq >= 1, "train.print_freq must be at least 1"),
        (config.data.workers >= 0, "data.workers must be 0 or more"),
        (config.data.image_size >= 0, "data.image_size must be 0 (auto) or a positive size"),
        (config.optim.lr > 0, "optim.lr must be positive"),
        (config.optim.weight_decay >= 0, "optim.weight_decay must be 0 or more"),
        (0 <= config.optim.momentum < 1, "optim.momentum must be in [0, 1)"),
        (0 <= config.optim.label_smoothing < 1, "optim.label_smoothing must be in [0, 1)"),
        (config.optim.warmup_epochs >= 0, "optim.warmup_epochs must be 0 or more"),
        (config.optim.step_epochs >= 1, "optim.step_epochs must be at least 1"),
        (config.parallel.gpus >= 0, "parallel.gpus must be 0 or more"),
        (not (config.parallel.gpus and config.parallel.devices),
         "give either --gpus or --devices, not both"),
        (config.parallel.bucket_mb > 0, "parallel.bucket_mb must be positive"),
        (config.parallel.check_every >= 1, "parallel.check_every must be at least 1"),
        (config.parallel.timeout_s > 0, "parallel.timeout_s must be positive"),
        (not isinstance(config.data.classes, int) or config.data.classes >= 0,
         "data.classes must be 0 (all), a positive count or a list of wnids"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def dump_toml(config: Config) -> str:
    return tomli_w.dumps(config.to_dict())


def config_from_dict(data: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config from `to_dict()` output (as stored in checkpoints)."""
    return make_config({(s, k): v for s, values in data.items() for k, v in values.items()})

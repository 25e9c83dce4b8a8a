"""The Python API's arguments, checked before any thread or process exists: each mistake is one
UserError naming the argument and what to pass. What only a step can show is checked there
(app/training/losses.py CheckedLoss).
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
from typing import Any

import torch
import torch.nn as nn

from app.config import Config
from app.config.sources import config_from_keywords, file_overrides, keyword_names
from app.runtime.devices import resolve_device
from app.runtime.errors import UserError, first_line
from app.training.user_parts import OPTIMIZER_NAMES, SCHEDULE_NAMES, parameter_index

# Config keys the API takes from its own arguments, and where each belongs there.
OWN_ARGUMENTS = {
    **dict.fromkeys(("dataset", "catalog", "classes", "train_index"),
                    "the images come from the train set: catalog.dataset(name).solutions(..., "
                    "classes=...) or .split(..., classes=...)"),
    **dict.fromkeys(("gpus", "devices", "device"), "pass devices= (a list, \"all\" or a count)"),
    **dict.fromkeys(("arch", "norm", "drop_path", "model_kwargs", "pretrained"),
                    "the API trains the model you pass: build it as you like (timm.create_model, "
                    "torchvision.models, your own class)"),
    **dict.fromkeys(("resume", "evaluate", "use_ema"), "pass resume= to app.train"),
    # The driver starts its processes again; app.train raises the failure in the caller instead.
    **dict.fromkeys(("max_restarts",), "app.train raises a replica's error in your thread: "
                    "continue with app.train(setup, ..., resume=True)"),
    **dict.fromkeys(("replicas_as",), "pass parallel=\"threads\" or \"processes\""),
    **dict.fromkeys(("schedule",), "pass schedule= to app.train (a name such as \"cosine\" "
                    "takes the config's)"),
    **dict.fromkeys(("loggers",), "pass logger= to app.train, or use app.logging_to"),
}


def keys(section: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{section}.{name}" for name in names)


# The config keys each argument stands in for: ignored from a config file (named in a warning),
# refused as keywords. Optimizer, loss and schedule only when they are objects (not None/names).
REPLACED_BY = {
    "model": keys("model", "arch", "norm", "drop_path", "model_kwargs", "pretrained"),
    "train_set": keys("data", "dataset", "catalog", "classes", "train_index"),
    "devices": (*keys("parallel", "gpus", "devices"), "train.device"),
    "resume": keys("run", "resume", "evaluate", "use_ema", "max_restarts"),
    "optimizer": keys("optim", "optimizer", "lr", "momentum", "nesterov", "weight_decay",
                      "norm_weight_decay", "bias_weight_decay"),
    "loss": ("optim.label_smoothing", *keys("model", "bce_loss", "bce_target_thresh")),
    "schedule": keys("optim", "schedule", "warmup_epochs", "lr_warmup_method",
                     "lr_warmup_decay", "lr_min", "lr_poly_power", "lr_peak_epoch",
                     "step_epochs", "step_gamma"),
}
KEEP_CONFIGS = {
    "optimizer": "set it there, or pass optimizer=None or a name "
                 f"({', '.join(OPTIMIZER_NAMES)})",
    "loss": "build it into yours, or pass loss=None",
    "schedule": "pass schedule=\"cosine\" (or another name) to app.train to use it",
}


def replaced(optimizer: Any, loss: Any = None, schedule: Any = "") -> list[str]:
    """The arguments whose values stand in for config keys (REPLACED_BY)."""
    given = {"optimizer": not (optimizer is None or isinstance(optimizer, str)),
             "loss": loss is not None, "schedule": not isinstance(schedule, str)}
    return ["model", "train_set", "devices", "resume", *(k for k, v in given.items() if v)]


def refuse_replaced_knobs(knobs: dict[str, Any], arguments: list[str]) -> None:
    """Keywords that shape what one of your own objects replaces: one line for them all."""
    names = keyword_names()
    for argument in (argument for argument in arguments if argument in KEEP_CONFIGS):
        given = [f"{knob}=" for knob in knobs
                 if ".".join(names.get(knob, ())) in REPLACED_BY[argument]]
        if given:
            raise UserError(f"prepare_training: {', '.join(given)} shape(s) the config's "
                            f"{argument}, but you pass your own {argument}=: "
                            f"{KEEP_CONFIGS[argument]}")


def api_spelling(key: str, value: Any = None) -> str:
    """A setting as a caller of prepare_training writes it: compile='on', parallel='processes'."""
    name = {"replicas_as": "parallel"}.get(key, key)
    return f"{name}=" if value is None else f"{name}={value!r}"


def api_config(knobs: dict[str, Any], config_file: str, optimizer: Any, parallel: str,
               devices: list[str]) -> Config:
    """The run config: defaults < `config_file` < keywords; the API's own arguments set the
    keys they stand for, and the file's keys that they replace are left out."""
    for name in knobs:
        if name in OWN_ARGUMENTS:
            raise UserError(f"prepare_training: {name}= is not a knob here; {OWN_ARGUMENTS[name]}")
    arguments = replaced(optimizer)
    refuse_replaced_knobs(knobs, arguments)
    ignore = {tuple(key.split(".")) for argument in arguments for key in REPLACED_BY[argument]}
    own: dict[str, Any] = {"devices": devices}
    if parallel:
        own["replicas_as"] = parallel
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZER_NAMES:
            raise UserError(f"optimizer={optimizer!r}: give an optimizer, a function "
                            f"parameters -> optimizer, or one of {', '.join(OPTIMIZER_NAMES)}")
        own["optimizer"] = optimizer
    config = config_from_keywords({**knobs, **own}, config_file, "prepare_training", ignore,
                                  api_spelling)
    if config.parallel.replicas_as == "auto":  # from Python, threads unless asked otherwise
        config = config_from_keywords({**knobs, **own, "replicas_as": "threads"}, config_file,
                                      "prepare_training", ignore, api_spelling)
    return config


def ignored_from_file(config_file: str, arguments: list[str]) -> str:
    """The warning naming what of `config_file` the caller's arguments replace ("" if none)."""
    if not config_file:
        return ""
    from_file = {".".join(key): value for key, value in file_overrides(config_file).items()}
    parts = []
    for argument in arguments:
        values = [f"{key.split('.')[1]} = {from_file[key]!r}" for key in REPLACED_BY[argument]
                  if key in from_file]
        if values:
            parts.append(f"your {argument} replaces {', '.join(values)}")
    return f"ignored from {config_file}: {'; '.join(parts)}" if parts else ""


def with_defaults(config: Config, arguments: list[str]) -> Config:
    """`config` with the keys these arguments replace back at their defaults (the file's
    values are not what the run uses, so config.toml does not show them)."""
    default = Config()
    changed = {}
    for key in (key for argument in arguments for key in REPLACED_BY[argument]):
        section, name = key.split(".")
        changed.setdefault(section, {})[name] = getattr(getattr(default, section), name)
    return dataclasses.replace(config, **{section: dataclasses.replace(
        getattr(config, section), **values) for section, values in changed.items()})


def resolve_devices(devices: Any) -> list[str]:
    """A list (["cuda:0", "cuda:1"], ["cpu", "cpu"]), "all" (every GPU, else one CPU) or a count."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices == "all":
        return [f"cuda:{i}" for i in range(visible)] or ["cpu"]
    if isinstance(devices, int) and not isinstance(devices, bool):
        if not visible:
            raise UserError(f"devices={devices}: this machine has no CUDA GPU; for replicas on "
                            f"the CPU pass devices={['cpu'] * max(devices, 1)}, or \"all\"")
        if not 1 <= devices <= visible:
            raise UserError(f"devices={devices}: this machine has {visible} CUDA GPU(s); pass "
                            f"at most {visible}, or a list such as [\"cpu\", \"cpu\"]")
        return [f"cuda:{i}" for i in range(devices)]
    if isinstance(devices, str):
        devices = [devices]
    if not isinstance(devices, (list, tuple)) or not devices or \
            not all(isinstance(d, (str, torch.device)) for d in devices):
        raise UserError(f"devices={devices!r}: pass a list such as [\"cuda:0\", \"cuda:1\"] or "
                        "[\"cpu\", \"cpu\"], \"all\", or a count of GPUs")
    resolved = []
    for device in devices:
        try:
            resolved.append(resolve_device(str(device)))
        except UserError as error:
            raise UserError(f"devices={[str(d) for d in devices]}: {error}") from None
    return resolved


def check_model(model: Any, num_classes: int, image_size: int) -> None:
    """An nn.Module with one logit per class: tried on one blank image in eval mode (its
    BatchNorm statistics untouched). A forward that fails here is left to the first step."""
    if not isinstance(model, nn.Module):
        raise UserError(f"model: got {type(model).__name__}; pass a torch.nn.Module")
    first = next(model.parameters(), None)
    if first is None:
        raise UserError("model: it has no parameters to train")
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            logits = model(torch.zeros(1, 3, image_size, image_size, device=first.device,
                                       dtype=first.dtype))
    except Exception:  # noqa: BLE001 (not this check's business: the first step reports it)
        return
    finally:
        model.train(was_training)
    if isinstance(logits, torch.Tensor) and (logits.dim() != 2 or logits.shape[1] != num_classes):
        raise UserError(f"model: its output for one image has shape {tuple(logits.shape)}, but "
                        f"the train set has {num_classes} classes; build it with num_classes="
                        f"{num_classes} (one logit per class)")


def check_optimizer(optimizer: Any, model: nn.Module) -> None:
    if optimizer is None or isinstance(optimizer, str):
        return
    if callable(optimizer):  # a factory: tried once here on the model's parameters
        try:
            optimizer = optimizer(model.parameters())
        except Exception as error:
            error.add_note("raised by optimizer=, called on model.parameters() in "
                           "prepare_training")
            raise
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"optimizer: your function returned {type(optimizer).__name__}, "
                            "not a torch.optim.Optimizer; return one built on the parameters "
                            "it is given")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"optimizer: got {type(optimizer).__name__}; pass an optimizer built on "
                        "model.parameters(), a function parameters -> optimizer, or a name")
    parameter_index(optimizer, model)


def check_loss(loss: Any, num_classes: int, config: Config) -> None:
    """A callable whose value for a blank batch is a scalar tensor (if it raises, the first step
    tells)."""
    if loss is None:
        return
    if not callable(loss):
        raise UserError(f"loss: got {type(loss).__name__}; pass a callable (logits, targets) -> "
                        "scalar tensor, such as torch.nn.CrossEntropyLoss()")
    mixing = config.augment.mixup_alpha or config.augment.cutmix_alpha
    targets = torch.full((2, num_classes), 1 / num_classes) if mixing else \
        torch.zeros(2, dtype=torch.long)
    try:
        value = loss(torch.zeros(2, num_classes, requires_grad=True), targets)
    except Exception:  # noqa: BLE001 (checked again at the first step, on real data)
        return
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserError(f"loss: returned {shape} for a batch of 2, not a scalar tensor; return "
                        "the batch's mean (reduction='mean' or .mean())")


def check_schedule(schedule: Any, config: Config) -> None:
    if isinstance(schedule, str):
        if schedule not in SCHEDULE_NAMES:
            raise UserError(f"schedule={schedule!r}: pass None (constant), a function (epoch, "
                            "step) -> factor, a function optimizer -> LR scheduler, or one of "
                            f"{', '.join(SCHEDULE_NAMES)}")
        return
    if schedule is not None and not callable(schedule):
        raise UserError(f"schedule: got {type(schedule).__name__}; pass None, a function "
                        "(epoch, step) -> LR factor or a function optimizer -> LR scheduler")


def check_picklable(objects: dict[str, Any]) -> None:
    """Worker processes are spawned: what they run must pickle and be importable there."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    interactive = main_file is None or main_file.startswith("<")  # a prompt, or '<stdin>'
    for name, value in objects.items():
        kinds = defined_by(value)
        local = [kind for kind in kinds if getattr(kind, "__module__", "") == "__main__"]
        if interactive and local:
            raise UserError(f"{name}: {getattr(local[0], '__qualname__', local[0])} is defined "
                            "in this notebook or prompt, which spawned worker processes cannot "
                            "import; use parallel=\"threads\", or move it into a module")
        try:
            pickle.dumps(value)
        except Exception as error:  # noqa: BLE001 (whatever pickling raised, in one line)
            raise UserError(f"{name}: does not pickle ({first_line(error, 120, True)}), so it "
                            "cannot reach worker processes; use parallel=\"threads\"") from None


def modules_to_preload(parts: Any) -> tuple[str, ...]:
    """The modules the caller's objects come from (torchvision.models.resnet, a project's own
    module): the forkserver imports them once, not each replica as it unpickles them. A
    notebook's own classes (__main__) are rebuilt from the pickle; no module to import."""
    objects = (parts.model_template, parts.loss, parts.optimizer_spec, parts.schedule)
    modules = {getattr(kind, "__module__", None) for value in objects if value is not None
               for kind in defined_by(value)}
    return tuple(sorted(m for m in modules if m and m != "__main__" and m in sys.modules))


def defined_by(value: Any) -> list:
    """The classes or functions a spawned process must import to rebuild `value`: a module's
    own class and those of its submodules (a notebook's block inside nn.Sequential too)."""
    if isinstance(value, nn.Module):
        return list(dict.fromkeys(type(module) for module in value.modules()))
    return [value if isinstance(value, type) or callable(value) else type(value)]

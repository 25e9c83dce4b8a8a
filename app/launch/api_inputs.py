"""The Python API's arguments, checked before any replica starts: each mistake is one UserError
naming the argument and what to pass (the CLI's one line), raised before a thread or a
process exists. What only a step can show (a loss that needs real data) is checked there
(app/training/losses.py CheckedLoss), naming the same arguments.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import torch
import torch.nn as nn

from app.config import Config
from app.config.sources import config_from_keywords
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
    **dict.fromkeys(("replicas_as",), "pass parallel=\"threads\" or \"processes\""),
    **dict.fromkeys(("schedule",), "pass schedule= to app.train (a name such as \"cosine\" "
                    "takes the config's)"),
    **dict.fromkeys(("loggers",), "pass logger= to app.train, or use app.logging_to"),
}
OPTIMIZER_KNOBS = ("lr", "momentum", "nesterov", "weight_decay", "wd", "norm_weight_decay",
                   "bias_weight_decay")
SCHEDULE_KNOBS = ("warmup_epochs", "lr_warmup_epochs", "lr_warmup_method", "lr_warmup_decay",
                  "lr_min", "lr_poly_power", "lr_peak_epoch", "step_epochs", "step_gamma")
LOSS_KNOBS = ("label_smoothing", "bce_loss", "bce_target_thresh")


def api_config(knobs: dict[str, Any], config_file: str, optimizer: Any, parallel: str,
               devices: list[str]) -> Config:
    """The run config: defaults < `config_file` < keywords; the API's own arguments set the
    keys they stand for."""
    for name in knobs:
        if name in OWN_ARGUMENTS:
            raise UserError(f"prepare_training: {name}= is not a knob here; {OWN_ARGUMENTS[name]}")
        if name in OPTIMIZER_KNOBS and not (optimizer is None or isinstance(optimizer, str)):
            raise UserError(f"prepare_training: {name}= configures the config's optimizer, but "
                            "you passed your own: set it there, or pass optimizer=None or a "
                            f"name ({', '.join(OPTIMIZER_NAMES)})")
    own: dict[str, Any] = {"devices": devices}
    if parallel:
        own["replicas_as"] = parallel
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZER_NAMES:
            raise UserError(f"optimizer={optimizer!r}: give an optimizer, a function "
                            f"parameters -> optimizer, or one of {', '.join(OPTIMIZER_NAMES)}")
        own["optimizer"] = optimizer
    config = config_from_keywords({**knobs, **own}, config_file, "prepare_training")
    if config.parallel.replicas_as == "auto":  # from Python, threads unless asked otherwise
        config = config_from_keywords({**knobs, **own, "replicas_as": "threads"}, config_file,
                                      "prepare_training")
    return config


def resolve_devices(devices: Any) -> list[str]:
    """A list (["cuda:0", "cuda:1"], ["cpu", "cpu"]), "all" (every visible GPU, else one CPU
    device) or a count of GPUs."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices == "all":
        return [f"cuda:{i}" for i in range(visible)] or ["cpu"]
    if isinstance(devices, int) and not isinstance(devices, bool):
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
    if isinstance(optimizer, torch.optim.Optimizer):
        parameter_index(optimizer, model)
    elif not callable(optimizer):
        raise UserError(f"optimizer: got {type(optimizer).__name__}; pass an optimizer built on "
                        "model.parameters(), a function parameters -> optimizer, or a name")


def check_loss(loss: Any, num_classes: int, knobs: Config) -> None:
    """A callable whose value for a blank batch is a scalar tensor (a loss that fails on it
    is left to the first step)."""
    if loss is None:
        return
    if not callable(loss):
        raise UserError(f"loss: got {type(loss).__name__}; pass a callable (logits, targets) -> "
                        "scalar tensor, such as torch.nn.CrossEntropyLoss()")
    for name in LOSS_KNOBS:
        if getattr(knobs.optim, name, None) or getattr(knobs.model, name, None):
            raise UserError(f"loss: {name}= configures the config's loss, but you passed your "
                            "own: build it into yours, or pass loss=None")
    mixing = knobs.augment.mixup_alpha or knobs.augment.cutmix_alpha
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


def defined_by(value: Any) -> list:
    """The classes or functions a spawned process must import to rebuild `value`: a module's
    own class and those of its submodules (a notebook's block inside nn.Sequential too)."""
    if isinstance(value, nn.Module):
        return list(dict.fromkeys(type(module) for module in value.modules()))
    return [value if isinstance(value, type) or callable(value) else type(value)]


def check_schedule_knobs(schedule: Any, knobs: dict[str, Any]) -> None:
    given = [name for name in SCHEDULE_KNOBS if name in knobs]
    if given and not isinstance(schedule, str):
        raise UserError(f"{given[0]}= shapes the config's schedule; pass schedule=\"cosine\" (or "
                        "another name) to app.train to use it")


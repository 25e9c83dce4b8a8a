"""Models by name: any timm model, plus `<resnet>_small` variants for low-resolution images and
xse_resnext_mini (app/models/xse_resnext_mini.py).
Options reach timm.create_model as its own keyword arguments (--drop-path: drop_path_rate;
--model-kwargs: any other), so timm's defaults hold, such as its ResNets' zero-initialised last
BatchNorm of each block (each block begins as the identity, as in Goyal et al.)."""

from __future__ import annotations

import ast
import difflib
import importlib
import math
import re
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from app.models.pretrained import load_pretrained
from app.runtime.errors import UserError

if TYPE_CHECKING:
    from app.config import ModelConfig

SMALL_SUFFIX = "_small"
# This package's own models, each in app/models/<name>.py, entered in timm's registry there
PROJECT_MODELS = ("xse_resnext_mini",)


def group_norm(channels: int, **factory) -> nn.GroupNorm:
    """Up to 32 groups: its output does not depend on how a batch is split."""
    return nn.GroupNorm(math.gcd(32, channels), channels, **factory)


NORM_LAYERS = {"batch": None, "group": group_norm}  # None: the model's own (BatchNorm)


def parse_model_kwargs(items: list[str]) -> dict[str, Any]:
    """`key=value` items -> keyword arguments, as timm's train.py reads its --model-kwargs: a
    Python literal where the value is one (0.1, True, None, (2, 2)), else a string (blurpool)."""
    kwargs = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--model-kwargs: expected key=value, got {item!r}")
        try:
            kwargs[key.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = text.strip()
    return kwargs


def resolve_layer_names(kwargs: dict[str, Any]) -> dict[str, Any]:
    """timm's ResNet stem asks issubclass(aa_layer, ...), so a name must become a class first;
    timm's own resolver knows its names (avg, blur/blurpool, blurpc)."""
    if isinstance(kwargs.get("aa_layer"), str):
        from app.models.timm_lib import timm  # noqa: PLC0415, F401 (timm first, without wandb)
        from timm.layers.blur_pool import _normalize_aa_layer  # noqa: PLC0415
        try:
            return {**kwargs, "aa_layer": _normalize_aa_layer(kwargs["aa_layer"])}
        except AssertionError:
            raise UserError(f"--model-kwargs aa_layer={kwargs['aa_layer']}: unknown "
                            "anti-aliasing layer; timm knows avgpool, blurpool, blurpc") from None
    return kwargs


def create_model_from_config(config: ModelConfig, num_classes: int,
                             with_pretrained: bool = True) -> nn.Module:
    """The run's model; with --pretrained, loaded silently (the driver checked the weights). A
    resumed run passes `with_pretrained=False`: its checkpoint holds the weights."""
    model = create_model(config.arch, num_classes, config.norm, drop_path=config.drop_path,
                         model_kwargs=parse_model_kwargs(config.model_kwargs))
    if config.pretrained and with_pretrained:
        load_pretrained(model, config.pretrained)
    return model


def create_model(name: str, num_classes: int, norm: str = "batch", *, drop_path: float = 0.0,
                 model_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """A freshly initialised model. `<resnet>_small` has a 3x3 stride-1 stem and no max-pool, as
    CIFAR-style ResNets for 32-64 px inputs; its state_dict keys are its timm ResNet's."""
    # seconds to import: only where a model is built by name
    from app.models.timm_lib import timm  # noqa: PLC0415
    from timm.models.resnet import ResNet  # noqa: PLC0415
    for module in PROJECT_MODELS:  # each enters its model in timm's registry
        importlib.import_module(f"app.models.{module}")
    base = name.removesuffix(SMALL_SUFFIX)
    if not timm.is_model(base) and base.rpartition(".")[2][:1].isupper():
        # app.train records the caller's model class ("torchvision.models.resnet.ResNet",
        # "__main__.Net"): its constructor's arguments are not known here
        raise UserError(f"'{name}' is the model class of a run of app.train, which can only "
                        "be rebuilt in Python: build the model there and load the "
                        "checkpoint's weights into it (torch.load(PATH)['model'])")
    if not timm.is_model(base):
        close = difflib.get_close_matches(base, timm.list_models(), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see timm.list_models()"
        raise UserError(f"unknown model '{name}'; {hint}")
    user = resolve_layer_names(model_kwargs or {})
    kwargs = dict(user)
    if NORM_LAYERS[norm]:
        kwargs["norm_layer"] = NORM_LAYERS[norm]
    if drop_path:  # only when asked: the default stays valid for models without the option
        kwargs["drop_path_rate"] = drop_path
    try:
        model = timm.create_model(base, pretrained=False, num_classes=num_classes, **kwargs)
    except TypeError as error:
        message = rejected_option(name, norm, user, error)
        if message is None:
            raise  # nothing the user chose: a programming error
        raise UserError(message) from None
    if name.endswith(SMALL_SUFFIX):
        if not isinstance(model, ResNet) or not isinstance(model.conv1, nn.Conv2d):
            raise UserError(f"'{name}': the {SMALL_SUFFIX} variant exists only for plain-stem "
                            "ResNets (resnet18, resnet34, resnet50, ...)")
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def rejected_option(name: str, norm: str, user: dict[str, Any], error: TypeError
                    ) -> str | None:
    """The message for an option the model's constructor refused; None if the user chose none."""
    found = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    key = found.group(1) if found else ""
    if key in user:
        return f"model '{name}' has no option '{key}' (--model-kwargs {key}=...)"
    if key == "drop_path_rate":
        return f"model '{name}' does not accept --drop-path"
    if key == "norm_layer" or norm != "batch":
        return f"model '{name}' does not accept norm = '{norm}'"
    if user:
        return f"model '{name}' rejected --model-kwargs {', '.join(user)}: {error}"
    return None

"""Models by name: any timm model, plus `<resnet>_small` variants for low-resolution images."""

from __future__ import annotations

import difflib
import math

import timm
import torch.nn as nn
from timm.models.resnet import ResNet

from app.errors import UserError

SMALL_SUFFIX = "_small"


def group_norm(channels: int, **factory) -> nn.GroupNorm:
    """GroupNorm with up to 32 groups: its output does not depend on how a batch is split.
    `factory` takes timm's device/dtype arguments."""
    return nn.GroupNorm(math.gcd(32, channels), channels, **factory)


NORM_LAYERS = {"batch": None, "group": group_norm}  # None: the model's own (BatchNorm)


def create_model(name: str, num_classes: int, norm: str = "batch") -> nn.Module:
    """A freshly initialised model. `resnet18_small` (or any plain timm ResNet + `_small`) has
    a 3x3 stride-1 stem and no max-pool, as CIFAR-style ResNets use for 32-64 px inputs; its
    state_dict keys are those of the timm ResNet it is made from."""
    base = name.removesuffix(SMALL_SUFFIX)
    if not timm.is_model(base):
        close = difflib.get_close_matches(base, timm.list_models(), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see timm.list_models()"
        raise UserError(f"unknown model '{name}'; {hint}")
    kwargs = {"norm_layer": NORM_LAYERS[norm]} if NORM_LAYERS[norm] else {}
    try:
        model = timm.create_model(base, pretrained=False, num_classes=num_classes, **kwargs)
    except TypeError:
        raise UserError(f"model '{name}' does not accept norm = '{norm}'") from None
    if name.endswith(SMALL_SUFFIX):
        if not isinstance(model, ResNet) or not isinstance(model.conv1, nn.Conv2d):
            raise UserError(f"'{name}': the {SMALL_SUFFIX} variant exists only for plain-stem "
                            "ResNets (resnet18, resnet34, resnet50, ...)")
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model

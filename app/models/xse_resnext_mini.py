"""xse_resnext_mini: the net that held Imagenette's 128 px / 5-epoch row from 2020-10 to 2021-03
(85.77%, pete88b's "mini net" in fastai/imagenette's README): fastai's XResNet with one
SE-ResNeXt block a stage. timm has no such block (its BasicBlock takes no groups, byobnet's
groups the second convolution, not the first), so it is written here from timm's layers and
entered in timm's registry: every path that builds a model by name (training, predict, export,
the benchmarks) builds it as it builds any timm model.

Its shape, as fastai builds it (fastai.vision.models.xresnet, fastai.layers.ResBlock):
- stem: three 3x3 convolutions (32, 32, 64 channels, the first of stride 2), then a 3x3 max-pool;
- four stages of one block each (64, 128, 256, 512 channels; stride 2 from the second stage on).
  A block widens to 4x its channels in a 3x3 convolution of 64 groups, returns to its channels
  in a full 3x3 convolution whose BatchNorm starts at zero, then squeeze-and-excitation
  (reduction 8); the shortcut average-pools where the block strides and projects (1x1
  convolution, BatchNorm) where the channels change;
- Mish after every convolution but the block's last, and after the sum;
- weights drawn from Kaiming's normal (fan in), biases zero.
~12.9 M weights for 10 classes, about ResNet-18-D's cost an image at 128 px.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from app.models.timm_lib import timm  # noqa: F401  (timm first, without wandb)
from timm.layers import ConvNormAct, SEModule, get_act_layer
from timm.models import register_model

STAGE_CHANNELS = (64, 128, 256, 512)
GROUPS = 64
WIDTH_PER_GROUP = 4  # fastai's base_width: the grouped convolution is 4 / 64 of 64 groups wide
SE_REDUCTION = 8


class SEResNeXtBasicBlock(nn.Module):
    """fastai's ResBlock at expansion 1 with SEResNeXtBlock's widths."""

    def __init__(self, in_chs: int, out_chs: int, stride: int, act_layer: type[nn.Module],
                 norm_layer: type[nn.Module]):
        super().__init__()
        mid_chs = out_chs * WIDTH_PER_GROUP * GROUPS // 64
        self.conv1 = ConvNormAct(in_chs, mid_chs, 3, stride=stride, groups=GROUPS,
                                 norm_layer=norm_layer, act_layer=act_layer)
        self.conv2 = ConvNormAct(mid_chs, out_chs, 3, norm_layer=norm_layer, apply_act=False)
        self.se = SEModule(out_chs, rd_ratio=1 / SE_REDUCTION, act_layer=act_layer)
        shortcut: list[nn.Module] = []
        if stride != 1:
            shortcut.append(nn.AvgPool2d(stride, ceil_mode=True))
        if in_chs != out_chs:
            shortcut.append(ConvNormAct(in_chs, out_chs, 1, norm_layer=norm_layer,
                                        apply_act=False))
        self.shortcut = nn.Sequential(*shortcut)
        self.act = act_layer(inplace=True)

    def zero_init_last(self) -> None:
        """Each block begins as (nearly) the identity: its residual's last BatchNorm at zero."""
        norm = self.conv2.bn
        if getattr(norm, "weight", None) is not None:
            nn.init.zeros_(norm.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.se(self.conv2(self.conv1(x))) + self.shortcut(x))


class XSEResNeXtMini(nn.Module):
    """The model; timm's conventions for the head (num_classes, get_classifier,
    reset_classifier, num_features), so fine-tuning and export treat it as any timm model."""

    def __init__(self, num_classes: int = 1000, in_chans: int = 3, drop_rate: float = 0.0,
                 act_layer: Any = "mish", norm_layer: type[nn.Module] = nn.BatchNorm2d):
        super().__init__()
        act = get_act_layer(act_layer)
        stem_chs = (32, 32, STAGE_CHANNELS[0])
        stem, chs = [], in_chans
        for index, out_chs in enumerate(stem_chs):
            stem.append(ConvNormAct(chs, out_chs, 3, stride=2 if index == 0 else 1,
                                    norm_layer=norm_layer, act_layer=act))
            chs = out_chs
        self.stem = nn.Sequential(*stem)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages = []
        for index, out_chs in enumerate(STAGE_CHANNELS):
            stages.append(SEResNeXtBasicBlock(chs, out_chs, 1 if index == 0 else 2, act,
                                              norm_layer))
            chs = out_chs
        self.stages = nn.Sequential(*stages)
        self.num_features = chs
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(drop_rate)
        self.num_classes = num_classes
        self.fc = nn.Linear(chs, num_classes) if num_classes else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for block in self.stages:
            block.zero_init_last()

    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: str = "avg") -> None:
        self.num_classes = num_classes
        self.fc = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.maxpool(self.stem(x)))

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.global_pool(x).flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


@register_model
def xse_resnext_mini(pretrained: bool = False, **kwargs: Any) -> XSEResNeXtMini:
    """pete88b's Imagenette "mini net"; no published weights."""
    if pretrained:
        raise ValueError("xse_resnext_mini has no published weights")
    kwargs.pop("pretrained_cfg", None)
    kwargs.pop("pretrained_cfg_overlay", None)
    kwargs.pop("cache_dir", None)
    return XSEResNeXtMini(**kwargs)

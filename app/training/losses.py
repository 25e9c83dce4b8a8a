"""The training loss: cross-entropy, or timm's BinaryCrossEntropy (its ResNet Strikes Back
A1-A3 recipes), each taking class indices or the probability rows mixup/cutmix make.

Label smoothing as each reference applies it: cross-entropy smooths whatever targets it gets
(torchvision); timm's BCE smooths the one-hot rows it builds from indices, and with mixup timm
mixes smoothed rows. Our batch augmentation mixes plain one-hot rows, so mixed rows are smoothed
here (linear, so the targets are timm's). Unlike timm's train.py, --bce-loss without smoothing
or mixup stays BCE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from app.runtime.errors import UserError

if TYPE_CHECKING:
    from app.config import ModelConfig


def smooth(rows: torch.Tensor, smoothing: float) -> torch.Tensor:
    """timm's Mixup targets: on = 1 - s + s/C, off = s/C, mixed linearly."""
    return rows * (1.0 - smoothing) + smoothing / rows.shape[-1]


class SmoothedBinaryCrossEntropy(nn.Module):
    """timm's BinaryCrossEntropy with smoothing for index targets and for mixed rows alike.
    Everything stays on the device: shapes are known to the host, values are never read."""

    def __init__(self, smoothing: float = 0.0, target_threshold: float | None = None):
        super().__init__()
        self.smoothing = smoothing
        from app.models.timm_lib import timm  # noqa: PLC0415 (timm: only for --bce-loss)
        from timm.loss import BinaryCrossEntropy  # noqa: PLC0415
        self.bce = BinaryCrossEntropy(smoothing=smoothing, target_threshold=target_threshold)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Under autocast the logits are bf16/fp16, and timm builds index targets in the logits'
        # dtype: 1 - 0.1 + 1e-4 would round to 0.8984 in bf16. Cross-entropy runs in float32
        # under autocast anyway; BCE gets the same.
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if targets.shape == logits.shape and self.smoothing:
            targets = smooth(targets, self.smoothing)
        return self.bce(logits, targets)


def build_criterion(model: ModelConfig, label_smoothing: float) -> nn.Module:
    """The loss as configured; both take class indices or probability rows."""
    if model.bce_loss:
        return SmoothedBinaryCrossEntropy(label_smoothing, model.bce_target_thresh or None)
    return nn.CrossEntropyLoss(label_smoothing=label_smoothing)


class CheckedLoss:
    """The loss of a step, with the two mistakes a caller's model or loss can make told in one
    line at the first step that shows them (shapes only: host metadata, no sync)."""

    def __init__(self, criterion, num_classes: int):
        self.criterion = criterion
        self.num_classes = num_classes

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[1] != self.num_classes:
            raise UserError(f"model: its output has shape {tuple(logits.shape)}, but the data "
                            f"has {self.num_classes} classes; build it with num_classes="
                            f"{self.num_classes} (one logit per class)")
        loss = self.criterion(logits, targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(f"loss: returned {shape}, not a scalar tensor; return the batch's "
                            "mean (e.g. reduction='mean' or .mean())")
        return loss

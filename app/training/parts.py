"""What a run trains and how: the model, its optimizer, the LR schedule and the loss, which the
Trainer asks its `Parts` for once per replica: from the config (ConfigParts) or from the Python
API's caller (user_parts.py). Either way the loop is the same one.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

import torch
import torch.nn as nn

from app.models.factory import create_model_from_config
from app.training.job import TrainJob
from app.training.losses import build_criterion
from app.training.optim import build_optimizer, build_scheduler

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Replicas that are threads share torch's generator: one builds its model at a time.
_BUILDING = threading.Lock()


class Parts(Protocol):
    def model(self, job: TrainJob, fresh: bool) -> nn.Module:
        """This replica's model on the CPU; `fresh`: a new run (not a resume), which may start
        from pretrained weights."""

    def optimizer(self, model: nn.Module, job: TrainJob, global_batch: int, fused: bool
                  ) -> torch.optim.Optimizer:
        """The optimizer of this replica's (prepared, on-device) model."""

    def scheduler(self, optimizer: torch.optim.Optimizer, job: TrainJob, steps_per_epoch: int
                  ) -> torch.optim.lr_scheduler.LRScheduler:
        """Stepped once per optimizer step."""

    def criterion(self, job: TrainJob) -> Loss:
        """(logits, targets) -> the batch's mean loss; targets are class indices, or the
        probability rows mixup/cutmix make."""


class ConfigParts:
    """The driver's: everything from the config."""

    def model(self, job: TrainJob, fresh: bool) -> nn.Module:
        return create_model_from_config(job.config.model, job.tables.num_classes,
                                        with_pretrained=fresh)

    def optimizer(self, model: nn.Module, job: TrainJob, global_batch: int, fused: bool
                  ) -> torch.optim.Optimizer:
        return build_optimizer(model, job.config.optim, global_batch, fused=fused)

    def scheduler(self, optimizer: torch.optim.Optimizer, job: TrainJob, steps_per_epoch: int
                  ) -> torch.optim.lr_scheduler.LRScheduler:
        return build_scheduler(optimizer, job.config.optim, steps_per_epoch,
                               job.config.train.epochs)

    def criterion(self, job: TrainJob) -> Loss:
        return build_criterion(job.config.model, job.config.optim.label_smoothing)


def seeded_model(parts: Parts, job: TrainJob, seed: int) -> nn.Module:
    """The replica's model, initialised from `seed` alone: identical on every replica, and
    the same as a single worker's."""
    with _BUILDING:
        torch.manual_seed(seed)
        return parts.model(job, fresh=not job.resume_from)

"""An exponential moving average of the weights, with torchvision's semantics
(references/classification: --model-ema, --model-ema-steps, --model-ema-decay): updated after
every N-th optimizer step of an epoch, buffers included, the decay adjusted as torchvision does;
during the LR warmup each update copies the weights, so the average starts from the warmed-up
model. It never waits for the device (torchvision's update count, a device tensor read back
every update, is a host integer here), and the average is a second model of the same kind,
evaluated, saved and exported like the model itself.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from app.runtime.private_api import foreach


def adjusted_decay(decay: float, global_batch: int, every: int, epochs: int) -> float:
    """torchvision's adjustment: alpha = 1 - decay scaled by global batch x every / epochs."""
    alpha = min(1.0, (1.0 - decay) * global_batch * every / epochs)
    return 1.0 - alpha


class ModelEma:
    def __init__(self, model: nn.Module, decay: float, every: int = 1,
                 warmup_steps: int = 0):
        """`model`: the bare model (no DDP/compile wrapper) whose weights are averaged;
        `warmup_steps`: optimizer steps during which updates copy instead of averaging."""
        self.source = model
        self.module = copy.deepcopy(model).requires_grad_(False).eval()
        self.decay, self.every, self.warmup_steps = decay, every, warmup_steps
        self.updates = 0  # torchvision's n_averaged; 0: the next update copies
        self.averaged, self.sources = self._pairs(floating=True)
        self.copied, self.copied_sources = self._pairs(floating=False)

    def _pairs(self, floating: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(average's, model's) tensors: floating-point (averaged) or not (copied: counters)."""
        mine, theirs = [], []
        for average, source in zip(_tensors(self.module), _tensors(self.source)):
            if average.is_floating_point() == floating:
                mine.append(average)
                theirs.append(source)
        return mine, theirs

    def after_step(self, epoch_step: int, step: int) -> None:
        """Called after each optimizer step with its index in the epoch (0-based) and the
        number of steps taken in the run (after it)."""
        if epoch_step % self.every:
            return
        self.update()
        if step <= self.warmup_steps:  # torchvision: `if epoch < lr_warmup_epochs` resets
            self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        if self.updates == 0:
            foreach("copy_")(self.averaged, self.sources)
        else:  # average + (1 - decay) x (model - average)
            foreach("lerp_")(self.averaged, self.sources, 1.0 - self.decay)
        if self.copied:
            foreach("copy_")(self.copied, self.copied_sources)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.updates = int(state["updates"])


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach() for t in (*model.parameters(), *model.buffers())]


def build_ema(model: nn.Module, enabled: bool, decay: float, every: int, global_batch: int,
              epochs: int, warmup_epochs: float, steps_per_epoch: int) -> ModelEma | None:
    """The run's EMA (None without --model-ema); `global_batch` counts the images of one
    optimizer step over all workers, as torchvision's world size x batch size does."""
    if not enabled:
        return None
    return ModelEma(model, adjusted_decay(decay, global_batch, every, epochs), every,
                    warmup_steps=math.ceil(warmup_epochs * steps_per_epoch))

"""Optimizer with per-parameter weight decay, LR scaling by the global batch, LR schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from app.config import OptimConfig

# Parameters of these modules never get weight decay (chosen by type: names like 'bn' miss
# e.g. torchvision's `downsample.1` BatchNorm).
NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def param_groups(model: nn.Module, weight_decay: float, norm_weight_decay: float = 0.0,
                 bias_weight_decay: float = 0.0) -> list[dict]:
    """Weights get `weight_decay`, normalisation layers' parameters `norm_weight_decay`, other
    biases `bias_weight_decay` (torchvision's split). LARS and LAMB adapt only groups with decay
    (timm's rule). Norms and biases share one group when their decay is the same: the two-group
    layout of earlier checkpoints, which an optimizer's state is loaded into."""
    groups: dict[str, list] = {"decay": [], "norm": [], "bias": []}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if isinstance(module, NORM_TYPES):
                kind = "norm"
            else:
                kind = "bias" if name == "bias" else "decay"
            if kind == "bias" and norm_weight_decay == bias_weight_decay:
                kind = "norm"  # one shared group, in the order the model holds them
            groups[kind].append(param)
    decays = {"decay": weight_decay, "norm": norm_weight_decay, "bias": bias_weight_decay}
    return [{"params": params, "weight_decay": decays[kind]} for kind, params in groups.items()
            if params or kind != "bias"]


def scaled_lr(config: OptimConfig, global_batch: int) -> float:
    """The LR is given per 256 images (Goyal et al.): lr x global_batch / 256."""
    return config.lr * global_batch / 256


def build_optimizer(model: nn.Module, config: OptimConfig, global_batch: int,
                    fused: bool = False) -> torch.optim.Optimizer:
    """`fused` (SGD, AdamW): one kernel per step (Precision.fused_step says when and why);
    otherwise torch's default: foreach on CUDA, a loop over the parameters on a CPU."""
    groups = param_groups(model, config.weight_decay, config.norm_weight_decay,
                          config.bias_weight_decay)
    lr = scaled_lr(config, global_batch)
    fused_or_default = True if fused else None
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(config.momentum, 0.999),
                                 fused=fused_or_default)
    if config.optimizer in ("lars", "lamb", "ranger"):
        return timm_optimizer(config, groups, lr)
    return torch.optim.SGD(groups, lr=lr, momentum=config.momentum, nesterov=config.nesterov,
                           fused=fused_or_default)


def timm_optimizer(config: OptimConfig, groups: list[dict], lr: float) -> torch.optim.Optimizer:
    """timm's LARS (the MLPerf reference's trust coefficient and eps), LAMB (with its global
    gradient-norm clip at 1.0) or Ranger: fastai's, as its Imagenette leaderboard entries train,
    timm's Lookahead (6 steps, half way back) around RAdam with decoupled weight decay, beta2
    0.99 and eps 1e-6; timm is imported only for them."""
    from app.models.timm_lib import timm  # noqa: PLC0415
    import timm.optim  # noqa: PLC0415
    if config.optimizer == "ranger":
        radam = torch.optim.RAdam(groups, lr=lr, betas=(config.momentum, 0.99), eps=1e-6,
                                  decoupled_weight_decay=True)
        return timm.optim.Lookahead(radam, alpha=0.5, k=6)
    if config.optimizer == "lars":
        return timm.optim.Lars(groups, lr=lr, momentum=config.momentum,
                               nesterov=config.nesterov, trust_coeff=0.001, eps=0.0)
    return timm.optim.Lamb(groups, lr=lr, betas=(config.momentum, 0.999))


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float,
                   scaler: torch.amp.GradScaler | None = None) -> None:
    """Scale the (averaged, so identical on every replica) gradients down to a global L2 norm
    of `max_norm` (0: off). torch's foreach norm and a clamped factor keep it on the device: no
    host sync. Loss-scaled gradients are unscaled first, as GradScaler's docs prescribe."""
    if not max_norm:
        return
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


class WarmupSchedule:
    """LR factor per optimizer step: a warmup (torchvision's linear or constant), then cosine
    or polynomial decay down to `floor` (--lr-min as a share of the LR) or step decay; or FFCV's
    schedule. Built from the config on every start; checkpoints hold only the position in it."""

    def __init__(self, config: OptimConfig, steps_per_epoch: int, epochs: int,
                 floor: float = 0.0):
        self.kind = config.schedule
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs
        self.warmup_steps = round(config.warmup_epochs * steps_per_epoch)
        self.warmup_method, self.warmup_decay = config.lr_warmup_method, config.lr_warmup_decay
        self.total_steps = max(1, epochs * steps_per_epoch)
        self.step_epochs = config.step_epochs
        self.step_gamma = config.step_gamma
        self.floor = floor
        self.peak_epoch = config.lr_peak_epoch
        self.poly_power = config.lr_poly_power

    def __call__(self, step: int) -> float:
        if self.kind == "ffcv":
            return self.ffcv(step / self.steps_per_epoch)
        if step < self.warmup_steps:
            if self.warmup_method == "constant":
                return self.warmup_decay
            if not self.warmup_decay:  # the first step already takes 1/W of the LR
                return (step + 1) / self.warmup_steps
            # torchvision's LinearLR(start_factor=decay), per step
            return self.warmup_decay + (1 - self.warmup_decay) * step / self.warmup_steps
        if self.kind == "step":
            return self.step_gamma ** (step // self.steps_per_epoch // self.step_epochs)
        if self.kind == "poly":  # MLPerf's: over the steps after the warmup, plus one
            left = 1 - (step - self.warmup_steps) / (self.total_steps - self.warmup_steps + 1)
            return self.floor + (1 - self.floor) * max(0.0, left) ** self.poly_power
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.floor + (1 - self.floor) * cosine

    def ffcv(self, epoch: float) -> float:
        """FFCV's get_cyclic_lr (1e-4 -> 1 at the peak epoch -> 0 at the end) at a fractional
        epoch: FFCV interpolates linearly between epochs, step by step, which is the same line."""
        if epoch <= self.peak_epoch:
            return 1e-4 + (1 - 1e-4) * epoch / max(self.peak_epoch, 1e-12)
        return max(0.0, (self.epochs - epoch) / max(self.epochs - self.peak_epoch, 1e-12))


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, steps_per_epoch: int,
                    epochs: int) -> torch.optim.lr_scheduler.LambdaLR:
    # --lr-min is an LR (torchvision's eta_min); the schedule works in shares of the run's LR
    floor = min(1.0, config.lr_min / optimizer.defaults["lr"])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupSchedule(config, steps_per_epoch, epochs, floor))


def restore_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, state: dict) -> None:
    """Continue at the saved step, on the schedule of the current config (more --epochs
    stretch the cosine); one saved with other steps per epoch (a new global batch) goes on from the
    same epoch. A scheduler that is not a function of the step (a caller's own) loads its state."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        scheduler.load_state_dict(state)
        return
    schedules = scheduler.lr_lambdas
    saved = (state.get("lr_lambdas") or [None])[0]  # the saved WarmupSchedule's attributes
    counted_in = saved.get("steps_per_epoch") if isinstance(saved, dict) else None
    step = state["last_epoch"]
    counts_in = getattr(schedules[0], "steps_per_epoch", counted_in)  # a caller's: as saved
    if counted_in and counted_in != counts_in:
        step = round(step * counts_in / counted_in)
    scheduler.load_state_dict({**state, "last_epoch": step,
                               "lr_lambdas": [None] * len(schedules)})  # None: keep ours
    for group, base, schedule in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                     schedules):
        group["lr"] = base * schedule(scheduler.last_epoch)

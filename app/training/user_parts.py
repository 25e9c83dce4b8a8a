"""The Parts of a run started from Python: the caller's own model, optimizer, schedule and loss
(what each may be: app/launch/python_api.py), one copy per replica: a deep copy of the model,
and an optimizer of the caller's class, param groups, hyperparameters and state.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from app.config.schema import OptimConfig
from app.runtime.errors import UserError
from app.training.job import TrainJob
from app.training.parts import ConfigParts, Loss

SCHEDULE_NAMES = OptimConfig.__dataclass_fields__["schedule"].metadata["choices"]
OPTIMIZER_NAMES = OptimConfig.__dataclass_fields__["optimizer"].metadata["choices"]


@dataclass(frozen=True)
class UserParts:
    model_template: nn.Module
    optimizer_spec: Any = None
    schedule: Any = None
    loss: Loss | None = None

    def model(self, job: TrainJob, fresh: bool) -> nn.Module:
        return copy.deepcopy(self.model_template)  # one replica at a time (seeded_model)

    def optimizer(self, model: nn.Module, job: TrainJob, global_batch: int, fused: bool
                  ) -> torch.optim.Optimizer:
        spec = self.optimizer_spec
        if spec is None or isinstance(spec, str):
            return ConfigParts().optimizer(model, job, global_batch, fused)
        if isinstance(spec, torch.optim.Optimizer):
            return replica_optimizer(spec, self.model_template, model)
        return spec(model.parameters())

    def scheduler(self, optimizer: torch.optim.Optimizer, job: TrainJob, steps_per_epoch: int
                  ) -> torch.optim.lr_scheduler.LRScheduler:
        schedule = self.schedule
        if isinstance(schedule, str):
            return ConfigParts().scheduler(optimizer, job, steps_per_epoch)
        if schedule is None:
            return torch.optim.lr_scheduler.LambdaLR(optimizer, constant)
        if takes_epoch_and_step(schedule):
            return torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                     epoch_and_step(schedule, steps_per_epoch))
        scheduler = schedule(optimizer)
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise UserError(f"schedule: returned {type(scheduler).__name__}, not a torch LR "
                            "scheduler; return one built on the optimizer it is given")
        return scheduler

    def criterion(self, job: TrainJob) -> Loss:
        return ConfigParts().criterion(job) if self.loss is None else self.loss


def constant(_step: int) -> float:
    return 1.0


def epoch_and_step(factor: Callable[[int, int], float], steps_per_epoch: int
                   ) -> Callable[[int], float]:
    """A caller's factor(epoch, step in epoch) as LambdaLR's factor(step). A closure, not an
    object: LambdaLR saves an object's attributes in its state (the caller's function, which
    may not pickle into a checkpoint), a function's not."""
    def at_step(step: int) -> float:
        return factor(*divmod(step, steps_per_epoch))
    return at_step


def takes_epoch_and_step(function: Callable) -> bool:
    """Two required positional parameters: factor(epoch, step); one: scheduler(optimizer). An
    LR scheduler class is a scheduler factory whatever its defaults (LinearLR(optimizer,
    start_factor=..., ...)); so is `lambda optimizer, n=10: ...`."""
    if isinstance(function, type) and issubclass(function, torch.optim.lr_scheduler.LRScheduler):
        return False
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [p for p in parameters if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) >= 2


def replica_optimizer(template: torch.optim.Optimizer, source: nn.Module, replica: nn.Module
                      ) -> torch.optim.Optimizer:
    """An optimizer of the template's class over the replica's parameters: the same groups
    (a parameter's place in model.parameters() finds its copy), hyperparameters and state."""
    index = parameter_index(template, source)
    params = list(replica.parameters())
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [params[index[id(p)]] for p in group["params"]]}
              for group in template.param_groups]
    optimizer = construct(type(template), groups, template.defaults)
    optimizer.load_state_dict(template.state_dict())  # moved to the replica's device
    return optimizer


def parameter_index(template: torch.optim.Optimizer, source: nn.Module) -> dict[int, int]:
    """Where each of the optimizer's parameters sits in source.parameters(); one that is not
    the model's is the caller's mistake."""
    index = {id(p): i for i, p in enumerate(source.parameters())}
    for group in template.param_groups:
        for param in group["params"]:
            if id(param) not in index:
                raise UserError("optimizer: built on parameters that are not the model's (another "
                                "model's, or a copy's); build it on model.parameters(), or pass "
                                "a function that builds it on the parameters it is given")
    return index


def construct(kind: type, groups: list[dict], defaults: dict[str, Any]) -> torch.optim.Optimizer:
    """kind(groups, **defaults), leaving out defaults its constructor does not take."""
    accepted = inspect.signature(kind).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        defaults = {k: v for k, v in defaults.items() if k in accepted}
    return kind(groups, **defaults)

"""--pretrained: a new run (epoch 0, a fresh optimizer) that starts from saved weights, unlike
--resume, which continues one. Keys are matched by name and shape; only the classifier may
differ (another class count, or none saved): it then keeps the fresh initialisation under the
run's seed, so every worker starts from the same weights without sending them anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from app.models import saved_weights
from app.models.saved_weights import SavedWeights
from app.runtime.errors import UserError


@dataclass(frozen=True)
class Match:
    loaded: dict[str, torch.Tensor]  # the model's keys that take the saved tensors
    fresh: tuple[str, ...]  # the classifier's keys that keep their initialisation
    saved_classes: int | None  # the saved classifier's class count (None: it has none)


def head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Key prefixes of the model's classifier (timm models name it: `fc.` for ResNets)."""
    if not hasattr(model, "get_classifier"):
        return ()
    classifier = model.get_classifier()
    return tuple(f"{name}." for name, module in model.named_modules()
                 if module is classifier and name)


def match(target: dict[str, torch.Tensor], saved: dict[str, torch.Tensor],
          head: tuple[str, ...], where: str) -> Match:
    """Which saved tensors load into which of the model's keys; `where` names the weights
    (and what they were trained as) in the message of the first key that does not fit."""
    head_differs = any(saved.get(key) is None or saved[key].shape != value.shape
                       for key, value in target.items() if key.startswith(head))
    loaded, fresh = {}, []
    for key, value in target.items():
        theirs = saved.get(key)
        if key.startswith(head) and head_differs:
            fresh.append(key)
        elif theirs is None:
            raise UserError(f"--pretrained {where}: it has no {key} (the first key of this "
                            "model it lacks); check --arch")
        elif theirs.shape != value.shape:
            raise UserError(f"--pretrained {where}: {key} has shape {list(theirs.shape)} "
                            f"there but {list(value.shape)} in this model; check --arch")
        else:
            loaded[key] = theirs
    unknown = [key for key in saved if key not in target]
    if unknown:
        raise UserError(f"--pretrained {where}: {unknown[0]} is not a key of this model "
                        f"({len(unknown)} such keys); check --arch")
    weight = next((saved[k] for k in target if k.startswith(head) and k.endswith("weight")
                   and k in saved), None)
    return Match(loaded, tuple(fresh), None if weight is None else weight.shape[0])


def load_pretrained(model: nn.Module, source: str,
                    report: Callable[[str], None] | None = None) -> SavedWeights:
    """`source`'s weights into `model`; `report` hears of a re-initialised classifier."""
    saved = saved_weights.read(source)
    where = source + (f" ({saved.spec.arch})" if saved.spec else "")
    state = model.state_dict()
    found = match(state, saved.weights, head_prefixes(model), where)
    with torch.no_grad():
        for key, value in found.loaded.items():
            state[key].copy_(value)
    if found.fresh and report:
        classes = getattr(model, "num_classes", "its")
        had = f"the weights have {found.saved_classes}" if found.saved_classes else \
            "the weights have no classifier"
        names = sorted({key.rsplit(".", 1)[0] for key in found.fresh})
        report(f"--pretrained {source}: {', '.join(names)} re-initialised for {classes} "
               f"classes ({had}); {len(found.loaded)} other tensors loaded")
    return saved


def check(model: nn.Module, source: str, wnids: list[str], evaluate: bool,
          report: Callable[[str], None]) -> str | None:
    """Before any worker starts: the weights fit `model` (else a UserError). A classifier of other
    classes than the dataset's is an error when evaluating, else the returned warning."""
    saved = load_pretrained(model, source, report)
    names = list(saved.spec.class_names) if saved.spec else []
    if not names or len(names) != len(wnids) or names == wnids:
        return None
    index = next(i for i, (a, b) in enumerate(zip(names, wnids)) if a != b)
    message = (f"--pretrained {source}: its class {index} is {names[index]}, the dataset's is "
               f"{wnids[index]}")
    if evaluate:
        raise UserError(f"{message}; evaluate on the classes it was trained on (--classes)")
    return f"{message}; its classifier is kept and learns the new classes"

"""A checkpoint or an export folder -> the model (eval mode, its weights loaded), its eval
transform and what its class indices mean: what predict, export and validate share. Plain state
dicts are refused: they do not say which model they are (--pretrained takes them, with --arch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from app.data.augment import EvalRecipe
from app.models import saved_weights
from app.models.factory import create_model, parse_model_kwargs
from app.models.saved_weights import ModelSpec
from app.runtime.errors import UserError
from app.training import checkpoint


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module  # on the CPU, float32, in eval mode
    spec: ModelSpec
    source: str
    kind: str  # "checkpoint" or "export"

    @property
    def recipe(self) -> EvalRecipe:
        """The validation transform the model was evaluated with (app/data/augment.py)."""
        return EvalRecipe(self.spec.crop, self.spec.crop_fraction)

    def labels(self) -> list[tuple[str, str]]:
        """(name, words) per class index; the index itself when the names are unknown."""
        names, words = self.spec.class_names, self.spec.class_words
        if not names:
            return [(str(i), "") for i in range(self.spec.num_classes)]
        return [(name, words[i] if i < len(words) else "") for i, name in enumerate(names)]


def build(spec: ModelSpec) -> nn.Module:
    return create_model(spec.arch, spec.num_classes, spec.norm,
                        model_kwargs=parse_model_kwargs(list(spec.model_kwargs)))


def open_model(location: str, ema: bool = False) -> LoadedModel:
    """`ema`: the checkpoint's EMA weights instead of the trained ones."""
    saved = saved_weights.read(location)
    if saved.spec is None:
        raise UserError(f"{location} is a plain state dict: it does not say which model it is; "
                        "give a checkpoint or an export folder (or train from it with "
                        "--pretrained and --arch)")
    weights = saved.weights
    if ema:
        if saved.kind != "checkpoint":
            raise UserError(f"{location} is an export: it holds one set of weights (--ema is "
                            "for checkpoints)")
        if saved.ema is None:
            raise UserError(f"{location} has no EMA weights (trained without --model-ema)")
        weights = saved.ema
    model = build(saved.spec)
    checkpoint.load_model_weights(model, weights, location)
    return LoadedModel(model.float().eval(), saved.spec, location, saved.kind)

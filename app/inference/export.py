"""A checkpoint -> a folder that the tools serving models take: model.safetensors and
config.json in timm's local-dir form (`timm.create_model("local-dir:DIR", pretrained=True)`
loads it), and optionally model.onnx for ONNX Runtime. config.json's `imagenet_dp` section holds
what timm's fields cannot say (the _small stem, GroupNorm), so our own tools rebuild any model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from app.inference.model_files import LoadedModel, open_model
from app.models.factory import PROJECT_MODELS, SMALL_SUFFIX, parse_model_kwargs
from app.models.saved_weights import (EXPORT_CONFIG, EXPORT_ONNX, EXPORT_WEIGHTS, ONNX_INPUT,
                                      ONNX_OUTPUT, OUR_SECTION, ModelSpec)
from app.runtime.errors import UserError, first_line
from app.runtime.files import atomic_path, write_atomically

ONNX_EXAMPLE_BATCH = 2  # the traced batch; the exported one is dynamic
CHATTY_LOGGERS = ("onnxscript", "onnx_ir", "torch.onnx")


def export(location: str, out_dir: str | Path, ema: bool = False, onnx: bool = False,
           report: Callable[[str], None] = print) -> list[Path]:
    """Export the checkpoint (or export folder) at `location`; returns the files written."""
    return export_model(open_model(location, ema), out_dir, ema, onnx, report)


def export_model(loaded: LoadedModel, out_dir: str | Path, ema: bool = False,
                 onnx: bool = False, report: Callable[[str], None] = print) -> list[Path]:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create {out}: {first_line(error)}") from None
    written = [write_weights(loaded.model, out / EXPORT_WEIGHTS)]
    config = timm_config(loaded, ema)
    write_atomically(out / EXPORT_CONFIG, json.dumps(config, indent=2) + "\n")
    written.append(out / EXPORT_CONFIG)
    if onnx:
        written.append(write_onnx(loaded.model, loaded.spec.crop, out / EXPORT_ONNX))
    caveat = timm_caveat(loaded.spec)
    if caveat:
        report(f"note: {caveat}: timm.create_model cannot rebuild it from config.json; "
               "predict.py, validate.py and model.onnx can")
    return written


def write_weights(model: nn.Module, path: Path) -> Path:
    from safetensors.torch import save  # noqa: PLC0415
    # safetensors takes contiguous tensors that share no memory: a state dict's own views
    # (channels_last, tied weights) are copied into plain ones.
    tensors = {key: value.detach().contiguous().clone()
               for key, value in model.state_dict().items()}
    write_atomically(path, save(tensors, metadata={"format": "pt"}))
    return path


def timm_config(loaded: LoadedModel, ema: bool) -> dict[str, Any]:
    spec, model = loaded.spec, loaded.model
    own = getattr(model, "pretrained_cfg", {}) or {}
    pretrained_cfg = {
        "input_size": [3, spec.crop, spec.crop],
        "interpolation": "bilinear",  # Pillow's antialiased bilinear, as the val transform
        "crop_pct": spec.crop_fraction,
        "crop_mode": "center",
        "mean": list(spec.mean),
        "std": list(spec.std),
        "num_classes": spec.num_classes,
        "fixed_input_size": False,
        "first_conv": own.get("first_conv", "conv1"),
        "classifier": own.get("classifier", "fc"),
    }
    config: dict[str, Any] = {"architecture": spec.arch.removesuffix(SMALL_SUFFIX),
                              "num_classes": spec.num_classes,
                              "num_features": getattr(model, "num_features", None)}
    if spec.class_names:
        config["label_names"] = list(spec.class_names)
        words = spec.class_words or ("",) * len(spec.class_names)
        config["label_descriptions"] = dict(zip(spec.class_names, words))
    args = timm_model_args(spec)
    if args:
        config["model_args"] = args
    config["pretrained_cfg"] = pretrained_cfg
    config[OUR_SECTION] = {"arch": spec.arch, "norm": spec.norm,
                           "model_kwargs": list(spec.model_kwargs), "source": loaded.source,
                           "ema": ema}
    return config


def timm_model_args(spec: ModelSpec) -> dict[str, Any]:
    """--model-kwargs that timm.create_model takes as they are (JSON values)."""
    args = {}
    for key, value in parse_model_kwargs(list(spec.model_kwargs)).items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        args[key] = value
    return args


def timm_caveat(spec: ModelSpec) -> str:
    """What of the model timm cannot build by name ("" when nothing)."""
    kwargs = parse_model_kwargs(list(spec.model_kwargs))
    reasons = []
    if spec.arch in PROJECT_MODELS:
        reasons.append(f"{spec.arch} is this project's model (app/models/{spec.arch}.py)")
    if spec.arch.endswith(SMALL_SUFFIX):
        reasons.append(f"{spec.arch} is this project's variant (3x3 stem, no max-pool)")
    if spec.norm != "batch":
        reasons.append(f"its norm layers are {spec.norm} norm")
    if isinstance(kwargs.get("aa_layer"), str):
        reasons.append(f"aa_layer={kwargs['aa_layer']} is a name timm's ResNet does not take")
    return "; ".join(reasons)


def write_onnx(model: nn.Module, size: int, path: Path) -> Path:
    """model.onnx: a dynamic batch, float32 in, logits (no softmax) out; torch.export writes it."""
    example = torch.randn(ONNX_EXAMPLE_BATCH, 3, size, size)
    batch = torch.export.Dim("batch", min=1)
    quiet = [logging.getLogger(name) for name in CHATTY_LOGGERS]
    levels = [logger.level for logger in quiet]
    for logger in quiet:  # their optimizer passes log each step at INFO
        logger.setLevel(logging.WARNING)
    try:
        with atomic_path(path) as temporary:
            torch.onnx.export(model.eval(), (example,), str(temporary), dynamo=True,
                              input_names=[ONNX_INPUT], output_names=[ONNX_OUTPUT],
                              dynamic_shapes=({0: batch},), external_data=False, verbose=False)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return path

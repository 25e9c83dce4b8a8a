"""What a saved model holds, read from a local path or any fsspec URL: our checkpoints, our
exports (timm's local-dir form: model.safetensors + config.json) and plain state dicts (timm's
or torchvision's, .pth or .safetensors). Reading only; torch reads with weights_only=True, so no
code from a downloaded file runs.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from dataclasses import dataclass

import torch

from app.catalog.locations import is_folder, join, read_bytes, read_cached
from app.data.augment import IMAGENET_MEAN, IMAGENET_STD
from app.data.resolution import DEFAULT_CROP_FRACTION, resolve
from app.runtime.errors import UserError, first_line

# The tag every checkpoint carries (app/training/checkpoint.py writes it): defined here, where saved
# files are told apart, so that reading a model needs nothing of the training loop's package.
CHECKPOINT_FORMAT = "imagenet-dp/1"
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"
EXPORT_ONNX = "model.onnx"
ONNX_INPUT, ONNX_OUTPUT = "input", "logits"  # model.onnx's graph: NCHW float32 -> logits
OUR_SECTION = "imagenet_dp"  # config.json's own section: what timm's fields cannot say
TORCH_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save's zip archive, or torch < 1.6's pickle
STRIPPED_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers' key prefixes


@dataclass(frozen=True)
class ModelSpec:
    """What rebuilds a model (the factory's arguments), feeds it (the centre crop of
    `crop_fraction` of the shorter side, resized to `crop`, then mean/std) and names its classes."""
    arch: str
    num_classes: int
    norm: str = "batch"
    model_kwargs: tuple[str, ...] = ()  # key=value items, as --model-kwargs takes them
    crop: int = 224
    crop_fraction: float = DEFAULT_CROP_FRACTION
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    class_names: tuple[str, ...] = ()
    class_words: tuple[str, ...] = ()
    selection: str = ""  # the --classes value that selects the model's classes again

    @property
    def resize(self) -> int:
        """The shorter side before the centre crop (torchvision's --val-resize-size)."""
        return round(self.crop / self.crop_fraction)


@dataclass(frozen=True)
class SavedWeights:
    source: str  # the path or URL, for messages
    kind: str  # "checkpoint", "export" or "weights" (a plain state dict)
    weights: dict[str, torch.Tensor]
    spec: ModelSpec | None = None  # None for plain state dicts: they say nothing else
    ema: dict[str, torch.Tensor] | None = None  # a checkpoint's EMA weights, if trained with


def read(source: str) -> SavedWeights:
    """A checkpoint, an export folder or a plain state dict at `source`."""
    if is_folder(source):
        return read_export(source)
    if source.endswith(".safetensors"):
        return SavedWeights(source, "weights", _safetensors(read_cached(source), source))
    payload = _torch_load(source)
    if isinstance(payload, dict) and payload.get("format") == CHECKPOINT_FORMAT:
        return SavedWeights(source, "checkpoint", payload["model"], spec_of_checkpoint(payload),
                            (payload.get("ema") or {}).get("model"))
    return SavedWeights(source, "weights", _state_dict(payload, source))


def read_export(folder: str) -> SavedWeights:
    config_path, weights_path = join(folder, EXPORT_CONFIG), join(folder, EXPORT_WEIGHTS)
    try:
        config = json.loads(read_bytes(config_path))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{config_path}: not a JSON file ({first_line(error, 100)})") from None
    weights = _safetensors(read_cached(weights_path), weights_path)
    return SavedWeights(folder, "export", weights, spec_of_export(config, config_path))


def spec_of_checkpoint(payload: dict) -> ModelSpec:
    """The spec of a checkpoint (app/training/run_state.py); no class names where it has none."""
    config = payload.get("config") or {}
    data, model = config.get("data") or {}, config.get("model") or {}
    sizes = resolve(data.get("image_size") or 224, val_resize=data.get("val_resize_size", 0),
                    val_crop=data.get("val_crop_size", 0))
    names = tuple(payload.get("class_names") or ())
    classes = data.get("classes", 0)
    selection = ",".join(names) if names else (
        ",".join(classes) if isinstance(classes, list) else str(classes))
    return ModelSpec(payload["arch"], payload["num_classes"], model.get("norm", "batch"),
                     tuple(model.get("model_kwargs") or ()), sizes.val_crop,
                     sizes.val_crop_fraction, tuple(data.get("mean") or IMAGENET_MEAN),
                     tuple(data.get("std") or IMAGENET_STD), class_names=names,
                     class_words=tuple(payload.get("class_words") or ()), selection=selection)


def spec_of_export(config: dict, where: str) -> ModelSpec:
    """The spec of a timm-form config.json (ours add OUR_SECTION: the _small stem, GroupNorm)."""
    ours = config.get(OUR_SECTION) or {}
    pretrained = config.get("pretrained_cfg") or config
    try:
        arch = ours.get("arch") or config["architecture"]
        num_classes = int(config.get("num_classes") or pretrained["num_classes"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{where}: no architecture and num_classes; is this a timm model "
                        "config?") from None
    kwargs = ours.get("model_kwargs")
    if kwargs is None:  # another exporter's: timm's reconstruction arguments
        kwargs = [f"{key}={value!r}" for key, value in (config.get("model_args") or {}).items()]
    names = config.get("label_names") or pretrained.get("label_names") or ()
    words = config.get("label_descriptions") or pretrained.get("label_descriptions") or {}
    size = pretrained.get("input_size") or (3, 224, 224)
    return ModelSpec(
        arch, num_classes, ours.get("norm", "batch"), tuple(kwargs), int(size[-1]),
        float(pretrained.get("crop_pct") or DEFAULT_CROP_FRACTION),
        tuple(pretrained.get("mean") or IMAGENET_MEAN),
        tuple(pretrained.get("std") or IMAGENET_STD),
        tuple(names), tuple(words.get(name, "") for name in names) if names else (),
        ",".join(names) if names else str(num_classes))


def _torch_load(location: str):
    data = read_cached(location)
    if not data.startswith(TORCH_MAGIC):
        raise UserError(f"{location} is not a PyTorch weights file (nor a folder with "
                        f"{EXPORT_CONFIG}, nor .safetensors)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
        what = f" ({found.group(1)})" if found else ""
        raise UserError(f"{location} holds more than tensors{what}, which weights_only=True "
                        "refuses; save its state_dict alone (timm: clean_checkpoint.py)"
                        ) from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, ValueError) as error:
        raise UserError(f"{location} is not a PyTorch weights file "
                        f"({first_line(error, 100, with_type=True)})") from None


def _safetensors(data: bytes, location: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import load  # noqa: PLC0415
    try:
        return load(data)
    except (SafetensorError, ValueError) as error:
        raise UserError(f"{location} is not a safetensors file ({first_line(error, 100)})"
                        ) from None


def _state_dict(payload, location: str) -> dict[str, torch.Tensor]:
    """A plain state dict, or one under "state_dict" (timm's train checkpoints) or "model"
    (torchvision's references); wrapper prefixes removed."""
    for key in ("state_dict", "model"):
        if isinstance(payload, dict) and isinstance(payload.get(key), dict):
            payload = payload[key]
            break
    if not isinstance(payload, dict) or not payload or not all(
            isinstance(v, torch.Tensor) for v in payload.values()):
        raise UserError(f"{location} is not a state dict (a dict of tensors)")
    return {_strip(key): value for key, value in payload.items()}


def _strip(key: str) -> str:
    while key.startswith(STRIPPED_PREFIXES):
        key = key.split(".", 1)[1]
    return key

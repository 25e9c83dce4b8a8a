"""Input pipelines by name (`data.decoder`): adding a decoder is one entry here.

Implementations are imported only when chosen: a machine without DALI runs the others. `auto`
on a GPU is DALI when it imports, else torchvision's nvJPEG (nothing to install); on a CPU,
Pillow: about as fast there (docs/results.md), it starts faster and decodes in the loader
processes rather than in the training process.
"""

from __future__ import annotations

from typing import Callable

import torch

from app.data.pipeline import InputPipeline, PipelineSpec
from app.runtime.errors import UserError


def _pillow(spec: PipelineSpec, options: dict) -> InputPipeline:  # no options of its own
    from app.data.pillow_pipeline import PillowPipeline  # noqa: PLC0415
    return PillowPipeline(spec)


def _nvjpeg(spec: PipelineSpec, options: dict) -> InputPipeline:  # nothing to tune yet
    from app.data.nvjpeg_pipeline import NvjpegPipeline  # noqa: PLC0415
    return NvjpegPipeline(spec)


def _dali(spec: PipelineSpec, options: dict) -> InputPipeline:
    if not dali_imports():
        raise UserError("--decoder dali: NVIDIA DALI does not import here; pip install "
                        "nvidia-dali-cuda130 (see requirements.txt), or --decoder pillow")
    from app.data.dali_pipeline import DaliPipeline  # noqa: PLC0415
    return DaliPipeline(spec, **options)


DECODERS: dict[str, Callable[[PipelineSpec, dict], InputPipeline]] = {
    "pillow": _pillow, "nvjpeg": _nvjpeg, "dali": _dali}


def dali_imports() -> bool:
    try:
        import nvidia.dali  # noqa: F401, PLC0415
    except (ImportError, OSError):  # not installed, or its libraries do not load
        return False
    return True


def resolve_decoder(decoder: str, device: torch.device) -> str:
    if decoder != "auto":
        return decoder
    if device.type != "cuda":
        return "pillow"
    return "dali" if dali_imports() else "nvjpeg"


def build_pipeline(decoder: str, spec: PipelineSpec, **options) -> InputPipeline:
    """`options` go to the implementation (DALI: hw_decoder_load)."""
    decoder = resolve_decoder(decoder, spec.form.device)
    if decoder not in DECODERS:
        raise UserError(f"unknown decoder '{decoder}'; known: auto, {', '.join(DECODERS)}")
    return DECODERS[decoder](spec, options)

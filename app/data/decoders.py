"""Input pipelines by name (`data.decoder`): adding a decoder is one entry here.

Implementations are imported only when chosen: a machine without a decoder's package can run
the others.
"""

from __future__ import annotations

from typing import Callable

from app.data.pipeline import InputPipeline, PipelineSpec
from app.errors import UserError


def _pillow(spec: PipelineSpec) -> InputPipeline:
    from app.data.pillow_pipeline import PillowPipeline  # noqa: PLC0415
    return PillowPipeline(spec)


DECODERS: dict[str, Callable[[PipelineSpec], InputPipeline]] = {"pillow": _pillow}


def build_pipeline(decoder: str, spec: PipelineSpec) -> InputPipeline:
    if decoder not in DECODERS:
        raise UserError(f"unknown decoder '{decoder}'; known: {', '.join(DECODERS)}")
    return DECODERS[decoder](spec)

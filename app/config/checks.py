"""Rules that involve several parameters of the run configuration (each parameter's own range
is declared beside it in app/config/schema.py and checked here too, in one pass)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from app.config.schema import Config, DataConfig
from app.runtime.errors import UserError


# How the user wrote a setting, for messages: flag_spelling for the driver ("--compile on"),
# the Python API's keywords for prepare_training ("compile='on'"). `value` None: the name alone.
Spelling = Callable[..., str]


def flag_spelling(key: str, value: Any = None) -> str:
    """The driver's flag for a config key (the keys named here have no alias)."""
    flag = "--" + key.replace("_", "-")
    return flag if value is None else f"{flag} {value}"


def validate(config: Config, spell: Spelling = flag_spelling) -> None:
    """Each parameter's own range (declared beside it), then what involves several."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for f in dataclasses.fields(values):
            check = f.metadata.get("check")
            if check and not check[0](getattr(values, f.name)):
                raise UserError(f"{section.name}.{f.name} {check[1]}, got "
                                f"{getattr(values, f.name)!r}")
    validate_progressive(config.data)
    if config.optim.lr_warmup_method == "constant" and not config.optim.lr_warmup_decay:
        raise UserError("--lr-warmup-method constant needs --lr-warmup-decay > 0 (the warmup's "
                        "LR factor; torchvision uses 0.01)")
    if config.run.use_ema and not config.run.evaluate:
        raise UserError("--use-ema selects the weights -e evaluates; training keeps and "
                        "evaluates both with --model-ema")
    if config.parallel.gpus and config.parallel.devices:
        raise UserError("give either --gpus or --devices, not both")
    if config.parallel.replicas_as == "threads":
        validate_threads(config, spell)
    if {"cpu", "cuda"} <= {device.split(":")[0] for device in config.parallel.devices}:
        # Replicas on both would step in different precisions and kernels (they must stay
        # bit-identical), and the parameter server orders with CUDA events a CPU worker lacks.
        raise UserError(f"--devices {','.join(config.parallel.devices)} mixes CPU and CUDA "
                        "devices; give all cuda:N or all cpu")


def validate_progressive(data: DataConfig) -> None:
    if not (data.progressive_start_size or data.progressive_end_size):
        return
    if not (data.progressive_start_size and data.progressive_end_size):
        raise UserError("progressive resizing needs both --progressive-start-size and "
                        "--progressive-end-size")
    if data.train_crop_size:
        raise UserError("give either --train-crop-size or progressive resizing "
                        "(--progressive-start-size ...), not both")
    if (data.progressive_start_size != data.progressive_end_size
            and data.progressive_end_epoch <= data.progressive_start_epoch):
        raise UserError(f"--progressive-end-epoch ({data.progressive_end_epoch}) must be after "
                        f"--progressive-start-epoch ({data.progressive_start_epoch})")


def validate_threads(config: Config, spell: Spelling = flag_spelling) -> None:
    """What replicas that are threads of one process cannot do, each with its reason."""
    processes = spell("replicas_as", "processes")
    if config.parallel.sync == "allreduce":
        raise UserError(f"{spell('sync', 'allreduce')} needs a process per replica "
                        "(torch.distributed); threads average through the parameter server: "
                        f"drop {spell('sync')} or use {processes}")
    if config.train.compile == "on":
        # pytorch/pytorch#118260, #136833: dynamo and inductor are not thread-safe
        raise UserError(f"{spell('compile', 'on')}: torch.compile is not thread-safe, so threads "
                        f"train eagerly; use {processes} to compile")
    if config.run.max_restarts:
        raise UserError(f"{spell('max_restarts')} restarts worker processes; threads cannot be "
                        f"replaced: use {processes}, or resume after a failure")

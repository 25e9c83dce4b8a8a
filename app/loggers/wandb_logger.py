"""Weights & Biases backend, one run per training job; the run's id is in every checkpoint, so
a resumed job continues the same wandb run. Empty settings defer to wandb's environment
variables (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, ...). wandb is imported here only: machines
without it can train with the other loggers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from app.loggers.base import NullLogger, RunInfo
from app.loggers.redact import redact
from app.runtime.errors import UserError, first_line

DEFAULT_PROJECT = "imagenet-dp"


class WandbLogger(NullLogger):
    def __init__(self, run: RunInfo):
        try:
            import wandb  # noqa: PLC0415
        except ImportError:
            raise UserError("--logger wandb: the wandb package is not installed here; "
                            "pip install wandb, or choose --logger console") from None
        self.wandb = wandb
        settings = run.settings
        try:
            self.run = wandb.init(
                project=settings.wandb_project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                entity=settings.wandb_entity or None, mode=settings.wandb_mode or None,
                tags=settings.wandb_tags or None, name=run.name, id=run.run_id,
                resume="allow", dir=os.environ.get("WANDB_DIR") or str(run.run_dir),
                config=redact(run.config), save_code=False)
        except Exception as error:  # noqa: BLE001 (wandb raises several kinds: say what to do)
            raise UserError(f"wandb could not start the run ({first_line(error, 200, True)}); "
                            "run `wandb login` or set WANDB_API_KEY, or WANDB_MODE=offline"
                            ) from None

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(redact(config), allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(metrics, step=step)

    def log_artifact(self, path: str | Path, name: str, kind: str,
                     aliases: tuple[str, ...] = ()) -> None:
        artifact = self.wandb.Artifact(name, type=kind)
        artifact.add_file(str(path))
        self.run.log_artifact(artifact, aliases=["latest", *aliases])

    def finish(self) -> None:
        self.run.finish()

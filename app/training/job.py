"""TrainJob: what the driver resolves once and every worker receives (picklable for spawn)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from app.catalog.storage import DatasetRoot
from app.catalog.tables import Tables
from app.catalog.uploader import Uploads
from app.config import Config
from app.data.resolution import Resolution
from app.loggers import RunInfo


@dataclass(frozen=True)
class TrainJob:
    config: Config  # resolved: dataset, image size and run name filled in
    root: DatasetRoot
    tables: Tables
    resolution: Resolution  # train size per epoch, val resize and crop
    run_dir: str
    resume_from: str = ""  # a checkpoint path, or "" to start fresh
    run_id: str = ""  # stable across resumes: names the run in wandb, stored in checkpoints
    # -b and --accum-steps as given, when a resume on another number of workers chose others
    # for the config (app/training/batch_layout.py); () when the config's are the user's
    requested_batch: tuple[int, int] = ()
    # --output-dir at a URL: the run folder's store (run_dir is then its staging folder here)
    output_store: DatasetRoot | None = None
    # ... and what the primary tells the upload process it saved (None: a local run folder)
    uploads: Uploads | None = field(default=None, compare=False)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.run_dir) / "checkpoints"

    def run_info(self) -> RunInfo:
        """What the loggers are told about this run."""
        return RunInfo(name=self.config.run.name, run_id=self.run_id, run_dir=Path(self.run_dir),
                       epochs=self.config.train.epochs, config=self.config.to_dict(),
                       settings=self.config.logging)

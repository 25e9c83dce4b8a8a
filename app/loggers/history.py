"""A run's history as a pandas DataFrame, one row per epoch: what app.train returns."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from app.loggers.plots import load_metrics

# metrics.jsonl's keys -> the DataFrame's columns, in this order
COLUMNS = {"epoch": "epoch", "train/epoch_loss": "train_loss", "val/top1": "val_top1",
           "val/top5": "val_top5", "val/loss": "val_loss",
           "train/epoch_images_per_sec": "images_per_sec", "train/epoch_lr": "lr",
           "epoch/time_s": "time_s", "val_ema/top1": "val_ema_top1",
           "val_ema/top5": "val_ema_top5", "val_ema/loss": "val_ema_loss",
           "train/skipped": "train_skipped", "val/skipped": "val_skipped"}


def epoch_history(metrics_path: str | Path) -> pd.DataFrame:
    """The epoch records of a run's metrics.jsonl, earlier sessions included (of a repeated
    epoch, its later record)."""
    path = Path(metrics_path)
    records = load_metrics(path) if path.is_file() else pd.DataFrame()
    if "val/images" not in records:  # no epoch ended yet
        return pd.DataFrame(columns=[c for k, c in COLUMNS.items() if not k.startswith("val_")])
    # every epoch record counts its val images (its top-1 is null when all were skipped)
    epochs = records[records["val/images"].notna()].drop_duplicates("epoch", keep="last")
    present = {key: column for key, column in COLUMNS.items() if key in epochs}
    return epochs[list(present)].rename(columns=present).reset_index(drop=True)

"""A tiny model trained once by the real driver, for the tests of what comes after training
(--pretrained, export, predict, validate): test_resnet at 32 px on the tiny sample."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import REPO, TINY_TRAIN_FLAGS, run_driver

CATALOG = ("--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny")


def train_tiny(cwd: Path, name: str = "source", epochs: int = 2, *flags: str) -> Path:
    """Trains in a real driver process; returns the run folder (runs/<name> under cwd)."""
    result = run_driver(*CATALOG, *TINY_TRAIN_FLAGS, "--epochs", str(epochs), "--run-name",
                        name, *flags, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return cwd / "runs" / name


def epoch_records(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "val/top1" in row]

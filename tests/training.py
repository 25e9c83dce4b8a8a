"""Helpers for tests that train in this process: a job from flags, a straight run beside one
interrupted and resumed, metrics records, and a detector of host syncs."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from app.config.sources import parse_config
from app.launch.run import prepare_job, write_run_folder
from app.loggers import NullLogger
from app.parallel.sync import LocalSync
from app.runtime.devices import WorkerEnv
from app.training import checkpoint
from app.training.trainer import Finished, train_worker
from conftest import REPO, TINY_TRAIN_FLAGS

CATALOG = ("--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny")


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class StopAfterFirstEpoch(NullLogger):
    """Stands in for a crash right after the first epoch's checkpoint was written."""

    def log_metrics(self, step, metrics):
        if "val/top1" in metrics:
            raise KeyboardInterrupt


def train_in_process(tmp_path, *flags):
    config, _ = parse_config([*CATALOG, *TINY_TRAIN_FLAGS, "--output-dir", str(tmp_path), *flags])
    job = prepare_job(config)
    write_run_folder(job)
    return job


def straight_and_resumed(tmp_path, epochs, steps_per_epoch, *flags):
    """The last checkpoints of a straight run and of one stopped after its first epoch, then
    resumed from last.pt."""
    flags = ("--epochs", str(epochs), *flags)
    straight = train_in_process(tmp_path, *flags, "--run-name", "straight")
    outcome = train_worker(straight, WorkerEnv(), LocalSync(), NullLogger())
    assert isinstance(outcome, Finished) and outcome.metrics["epoch"] == epochs

    interrupted = train_in_process(tmp_path, *flags, "--run-name", "interrupted")
    with pytest.raises(KeyboardInterrupt):
        train_worker(interrupted, WorkerEnv(), LocalSync(), StopAfterFirstEpoch())
    last = tmp_path / "interrupted" / "checkpoints" / "last.pt"
    assert (checkpoint.load(last)["epoch"], checkpoint.load(last)["step"]) == \
        (1, steps_per_epoch)
    resumed = train_in_process(tmp_path, *flags, "--resume", str(last))
    assert resumed.run_dir == str(tmp_path / "interrupted")  # same run continues
    train_worker(resumed, WorkerEnv(), LocalSync(), NullLogger())

    a = checkpoint.load(tmp_path / "straight" / "checkpoints" / "last.pt")
    b = checkpoint.load(last)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == \
        (epochs, epochs * steps_per_epoch)
    return a, b


class HostSyncs(TorchDispatchMode):
    """Records every op that hands a tensor's value to the host (`.item()`, `bool(t)`): on a
    GPU each one waits for the device."""

    OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))

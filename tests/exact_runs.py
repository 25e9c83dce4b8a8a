"""The exact runs: the tiny sample's 2-epoch run, deterministic on a CPU, in each way of
splitting it over workers; how a test stops or wounds one mid-run; and the check that an
interrupted run ended exactly where one never interrupted ends (conftest.py's `straight`)."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock

from app.training import checkpoint
from conftest import REPO, run_driver, worker_pids

CATALOG = ("--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny")
# Deterministic on CPU; BatchNorm on purpose: each replica's running statistics must survive.
# 5 classes: 160 train images, global batch 8: 20 steps per epoch.
EXACT = ("-a", "test_resnet", "--classes", "5", "--image-size", "32", "-j", "0", "--lr", "0.2",
         "--warmup-epochs", "0.5", "--epochs", "2", "-p", "1")
SPLITS = {"1 worker": ("-b", "8"),
          "2 workers ps": ("-b", "4", "--devices", "cpu,cpu", "--sync", "ps"),
          "2 workers allreduce": ("-b", "4", "--devices", "cpu,cpu", "--sync", "allreduce"),
          # 2 micro-batches of 2 per optimizer step: a SIGTERM mid-step saves after the step
          "2 workers allreduce accumulating": ("-b", "2", "--accum-steps", "2", "--devices",
                                               "cpu,cpu", "--sync", "allreduce"),
          # the recipe knobs: per-image ops, per-batch mixing and erasing, and the EMA, whose
          # BatchNorm statistics differ per replica until the epoch's end (no warmup: the EMA
          # averages from the first update on, alpha = 0.025 x 8 x 3 / 2 = 0.3)
          "2 workers ps recipe": ("-b", "4", "--devices", "cpu,cpu", "--sync", "ps",
                                  "--auto-augment", "ta_wide", "--mixup-alpha", "0.2",
                                  "--cutmix-alpha", "1.0", "--random-erase", "0.25",
                                  "--label-smoothing", "0.1", "--warmup-epochs", "0",
                                  "--model-ema", "--model-ema-steps", "3",
                                  "--model-ema-decay", "0.975"),
          # decoded and augmented in the training process (nvJPEG's path; libjpeg-turbo on a
          # CPU), the bytes read by a loader process
          "1 worker nvjpeg": ("-b", "8", "-j", "1", "--decoder", "nvjpeg", "--auto-augment",
                              "ta_wide")}


def last(run_dir):
    return checkpoint.load(run_dir / "checkpoints" / "last.pt")


def metric_rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def logged_step(run_dir, step: int) -> bool:
    """Whether the run in `run_dir` has logged step `step` (or a later one) yet."""
    return any(r["step"] >= step for r in metric_rows(run_dir))


def assert_bit_identical(a: dict, b: dict, end: tuple[int, int] = (2, 40)) -> None:
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == end
    for key in a["model"]:  # weights and BatchNorm statistics
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])
    assert (a.get("ema") is None) == (b.get("ema") is None)
    if a.get("ema"):
        assert a["ema"]["updates"] == b["ema"]["updates"]
        for key in a["ema"]["model"]:
            assert torch.equal(a["ema"]["model"][key], b["ema"]["model"][key]), key


def driver(*args: str) -> list[str]:
    """bin/driver.py in a Python process of its own, as a command."""
    return [sys.executable, str(REPO / "bin" / "driver.py"), *args]


def stop_with_sigterm_after(cwd, args, step: int) -> tuple[int, str]:
    """The driver with `args` (run "cut") in this process, sent SIGTERM once step `step` is
    logged, as a scheduler sends it to a driver: its exit code and stderr. To this process's
    main thread, where the driver's handler runs (to the thread, so that a wait it is in is
    interrupted at once)."""
    main = threading.main_thread().ident
    result = run_acting_at_step(cwd, args, step, lambda: signal.pthread_kill(main, signal.SIGTERM))
    return result.returncode, result.stderr


def kill_worker_after(cwd, args, step: int, victim: str) -> subprocess.CompletedProcess:
    """The driver with `args` (run "cut") in this process; once step `step` is logged, SIGKILL
    to `victim` ("worker 1 (cpu)"), as the driver named it in its first "started" line (a
    restart names new ones)."""
    started = StartedLines()
    logging.getLogger("imagenet_dp").addHandler(started)
    try:
        return run_acting_at_step(
            cwd, args, step, lambda: os.kill(worker_pids(started.lines[0])[victim], signal.SIGKILL))
    finally:
        logging.getLogger("imagenet_dp").removeHandler(started)


class StartedLines(logging.Handler):
    """The driver's "started <mode>: worker 0 (cpu) pid N, ..." log lines, as they come."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("started "):
            self.lines.append(message)


def run_acting_at_step(cwd, args, step: int, act: Callable[[], None]
                       ) -> subprocess.CompletedProcess:
    """`run_driver` of `args` (run "cut": its workers come from the session's forkserver,
    which imported torch once), with `act()` called from another thread once the run has
    logged step `step`; nothing is done if the run ends first."""
    ended = threading.Event()

    def act_at_step() -> None:
        while not ended.wait(0.05):
            if logged_step(cwd / "runs" / "cut", step):
                act()
                return
    actor = threading.Thread(target=act_at_step, daemon=True)
    actor.start()
    try:
        return run_driver(*args, cwd=cwd)
    finally:
        ended.set()
        actor.join()


def uninterrupted_end(cache: Path, split: str) -> dict:
    """The last checkpoint of the exact run in `split`, never stopped: what every interrupted
    run of that split must end with. Run once per suite into `cache`, a folder every test
    process of the suite shares (the first to ask runs it, the others wait on its lock)."""
    name = split.replace(" ", "-")
    run_dir = cache / "runs" / name
    with FileLock(cache / f"{name}.lock", timeout=600):
        if not (run_dir / "ended").exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # a try that failed
            result = run_driver(*CATALOG, *EXACT, *SPLITS[split], "--run-name", name, cwd=cache)
            assert result.returncode == 0, result.stderr[-3000:]
            (run_dir / "ended").touch()
    return last(run_dir)

"""Nothing lost: exact mid-epoch resume after SIGTERM, periodic checkpoints, a kill during a
checkpoint write, bad images listed and bounded."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from app import checkpoint
from app.interrupts import PREEMPTED_EXIT_CODE
from conftest import REPO, run_driver, skipped_rows

CATALOG = ("--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny")
# Deterministic on CPU; BatchNorm on purpose: each replica's running statistics must survive.
# 5 classes: 160 train images, global batch 8: 20 steps per epoch.
EXACT = ("-a", "test_resnet", "--classes", "5", "--image-size", "32", "-j", "0", "--lr", "0.2",
         "--warmup-epochs", "0.5", "--epochs", "2", "-p", "1")
SPLITS = {"1 worker": ("-b", "8"), "2 workers ps": ("-b", "4", "--devices", "cpu,cpu",
                                                     "--sync", "ps")}


def last(run_dir):
    return checkpoint.load(run_dir / "checkpoints" / "last.pt")


def metric_rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def stop_with_sigterm_after(cwd, args, step: int):
    """Start the driver, send SIGTERM once step `step` has been logged; returns its result."""
    process = subprocess.Popen([sys.executable, str(REPO / "bin" / "driver.py"), *args],
                               cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    run_dir = cwd / "runs" / "cut"
    deadline = time.monotonic() + 120
    while not any(r["step"] >= step for r in metric_rows(run_dir)):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=60)
    return code, process.stderr.read()


@pytest.mark.parametrize("split", SPLITS)
def test_sigterm_mid_epoch_then_resume_ends_bit_identical(tmp_path, split):
    flags = (*CATALOG, *EXACT, *SPLITS[split])
    straight = run_driver(*flags, "--run-name", "straight", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr

    code, stderr = stop_with_sigterm_after(tmp_path, (*flags, "--run-name", "cut"), step=5)
    assert code == PREEMPTED_EXIT_CODE, stderr
    assert "to continue: python" in stderr and "--resume auto --run-name cut" in stderr
    cut = last(tmp_path / "runs" / "cut")
    assert 0 < cut["epoch_step"] < 20 and cut["epoch"] < 2  # stopped inside an epoch
    assert len(cut["replicas"]) == (2 if "--devices" in SPLITS[split] else 1)

    resumed = run_driver(*flags, "--run-name", "cut", "--resume", "auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    a, b = last(tmp_path / "runs" / "straight"), last(tmp_path / "runs" / "cut")
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (2, 40)
    for key in a["model"]:  # weights and BatchNorm statistics
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])
    # The interrupted epoch's metrics count every image once, across the stop.
    interrupted = [r for r in metric_rows(tmp_path / "runs" / "cut")
                   if "val/top1" in r and r["epoch"] == cut["epoch"] + 1]
    assert interrupted[-1]["train/images"] == 160


def test_checkpoint_interval_saves_mid_epoch_and_keeps_the_newest(tmp_path):
    result = run_driver(*CATALOG, *EXACT, "-b", "4", "--devices", "cpu,cpu", "--epochs", "1",
                        "--checkpoint-interval", "0.005", "--keep-checkpoints", "2",
                        "--run-name", "timed", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "runs" / "timed" / "checkpoints"
    kept = sorted(folder.glob("step-*.pt"))
    assert len(kept) == 2 and kept[-1].name == "step-000000020.pt"
    assert (folder / "last.pt").samefile(kept[-1]) and (folder / "best.pt").samefile(kept[-1])
    mid_epoch = checkpoint.load(kept[0])  # a save requested by the driver's timer
    assert 0 < mid_epoch["epoch_step"] < 20 and mid_epoch["step"] == mid_epoch["epoch_step"]
    assert not list(folder.glob(".*"))  # no temporary files left


WRITER = """
import sys, time, torch
from app import checkpoint

class Stall:  # pickled while the new checkpoint is being written
    def __reduce__(self):
        print("writing", flush=True)
        time.sleep(600)
        return (int, ())

folder = checkpoint.CheckpointFolder(sys.argv[1], keep=3)
folder.save({"model": {"w": torch.full((4,), 1.0)}, "step": 1}, step=1)
folder.save({"model": {"w": torch.full((250_000,), 2.0)}, "step": 2, "stall": Stall()}, step=2)
"""


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path):
    folder = tmp_path / "checkpoints"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert writer.stdout.readline().strip() == "writing"
        partial = list(folder.glob(".step-000000002.pt.*.tmp"))
        assert len(partial) == 1  # the new checkpoint is being written
    finally:
        writer.kill()
        writer.wait(timeout=10)
    state = checkpoint.load(folder / "last.pt")
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.full((4,), 1.0))
    assert not (folder / "step-000000002.pt").exists()
    assert checkpoint.CheckpointFolder(folder, keep=3).remove_stale_temporaries() == partial


def damage(folder, relative, how):
    path = folder / relative
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    elif how == "zero-byte":
        path.write_bytes(b"")
    else:  # not an image at all
        path.write_text("<html>403 Forbidden</html>\n")
    return relative


@pytest.mark.parametrize("decoder", ["pillow", "dali"])
def test_bad_images_are_skipped_listed_and_bounded(tmp_path, tiny_copy, catalog_for, decoder):
    train = sorted((tiny_copy / "ILSVRC/Data/CLS-LOC/train").rglob("*.JPEG"))
    val = sorted((tiny_copy / "ILSVRC/Data/CLS-LOC/val").glob("*.JPEG"))
    root = tiny_copy
    bad = {damage(root, train[3].relative_to(root), "truncated"),
           damage(root, train[50].relative_to(root), "zero-byte"),
           damage(root, val[7].relative_to(root), "text")}
    flags = ("--catalog", str(catalog_for(tiny_copy)), "-a", "test_resnet", "--image-size",
             "32", "-b", "32", "-j", "1", "--epochs", "1", "--decoder", decoder)
    # 3 of 420 images (0.7%): under the default limit of 1%, so the run completes.
    ok = run_driver(*flags, "--run-name", "ok", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    rows = skipped_rows(tmp_path / "runs" / "ok")
    assert {row["path"] for row in rows} == {str(p) for p in bad} and len(rows) == 3
    assert {(row["epoch"], row["split"]) for row in rows} == {("1", "train"), ("1", "val")}
    assert "skipped 3 images" in ok.stdout

    strict = run_driver(*flags, "--run-name", "strict", "--max-bad-fraction", "0.005",
                        cwd=tmp_path)
    assert strict.returncode == 2
    message = strict.stderr.strip().splitlines()[-1]
    assert "3 of 420 images of epoch 1 could not be read or decoded (0.71%" in message
    assert "skipped.tsv" in message and "Traceback" not in strict.stderr

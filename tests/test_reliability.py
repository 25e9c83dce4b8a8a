"""Nothing lost: exact mid-epoch resume after SIGTERM, periodic checkpoints, restarts after a
killed worker (the driver's --max-restarts and torchrun's), a kill during a checkpoint write,
bad images listed and bounded."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from app.catalog.storage import DatasetRoot
from app.catalog.tables import load_tables
from app.data.sampler import ShardedBatches
from app.parallel.plans import free_port
from app.runtime.liveness import descendants
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE
from app.training import checkpoint
from conftest import REPO, read_line_with, run_driver, skipped_rows
from exact_runs import (CATALOG, EXACT, SPLITS, assert_bit_identical, driver, kill_worker_after,
                        last, logged_step, metric_rows, stop_with_sigterm_after)

# One machine, two ranks, restarted once: what a user types, with a free port for the store.
TORCHRUN = ("-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--max-restarts", "1", "--rdzv-backend", "c10d")


def start_until_step(cwd, command: list[str], step: int) -> subprocess.Popen:
    """Start `command` (torchrun around the driver) for run "cut"; return once it has logged
    step `step`."""
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not logged_step(cwd / "runs" / "cut", step):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)
    return process


@pytest.mark.parametrize("split", ["1 worker", "2 workers ps",
                                   "2 workers allreduce accumulating", "2 workers ps recipe",
                                   "1 worker nvjpeg"])
def test_sigterm_mid_epoch_then_resume_ends_bit_identical(straight, tmp_path, split):
    flags = (*CATALOG, *EXACT, *SPLITS[split], "--run-name", "cut")
    code, stderr = stop_with_sigterm_after(tmp_path, flags, step=5)
    assert code == PREEMPTED_EXIT_CODE, stderr
    assert "to continue: python" in stderr and "--resume auto --run-name cut" in stderr
    hint = next(line for line in stderr.splitlines() if "to continue: python" in line)
    assert hint.count("--run-name") == 1 and hint.count("--resume") == 1, hint
    cut = last(tmp_path / "runs" / "cut")
    assert 0 < cut["epoch_step"] < 20 and cut["epoch"] < 2  # stopped inside an epoch
    assert len(cut["replicas"]) == (2 if "--devices" in SPLITS[split] else 1)

    resumed = run_driver(*flags, "--resume", "auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert_bit_identical(straight(split), last(tmp_path / "runs" / "cut"))
    # The interrupted epoch's metrics count every image once, across the stop.
    interrupted = [r for r in metric_rows(tmp_path / "runs" / "cut")
                   if "val/top1" in r and r["epoch"] == cut["epoch"] + 1]
    assert interrupted[-1]["train/images"] == 160


# Killed in epoch 2, once step 23 is logged: the group starts again from the checkpoint of
# step 20 and repeats steps 21-23.
@pytest.mark.parametrize("split, victim", [("2 workers ps", "worker 0 (cpu)"),
                                           ("2 workers allreduce", "worker 1 (cpu)")])
def test_max_restarts_replaces_a_killed_worker_and_the_run_ends_bit_identical(
        straight, tmp_path, split, victim):
    flags = (*CATALOG, *EXACT, *SPLITS[split], "--max-restarts", "1", "--run-name", "cut")
    result = kill_worker_after(tmp_path, flags, step=23, victim=victim)
    code, stderr = result.returncode, result.stderr
    assert code == 0, stderr
    assert f"error: {victim} was killed by SIGKILL" in stderr
    assert ("restart 1 of 1 in 1 s, from runs/cut/checkpoints/last.pt after step 20 (0 steps "
            "into epoch 2)") in stderr
    run_dir = tmp_path / "runs" / "cut"
    (restart,) = [r for r in metric_rows(run_dir) if r.get("event") == "restart"]
    assert restart["step"] == 20 and restart["cause"].startswith(f"{victim} was killed")
    assert_bit_identical(straight(split), last(run_dir))


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The process torchrun started for `rank` (RANK is in its environment)."""
    for pid in descendants(torchrun_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if f"RANK={rank}".encode() in handle.read().split(b"\0"):
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no process of rank {rank} below torchrun")


def test_torchrun_max_restarts_replaces_a_killed_rank_and_the_run_ends_bit_identical(
        straight, tmp_path):
    command = [sys.executable, *TORCHRUN, "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               str(REPO / "bin" / "driver.py"), *CATALOG, *EXACT, "-b", "4", "--device", "cpu",
               "--run-name", "cut", "--resume", "auto"]
    process = start_until_step(tmp_path, command, step=23)
    os.kill(rank_pid(process.pid, 1), signal.SIGKILL)
    code, stderr = process.wait(timeout=180), process.stderr.read()
    assert code == 0, stderr[-3000:]
    # The rank that lost its peer says so in one line (as stopped, where torchrun's SIGTERM,
    # which ends the round, reached it first); no process printed a traceback.
    assert len(re.findall(r"(error: rank 0|stopped by SIGTERM at once): lost a peer: ",
                          stderr)) == 1 and "Traceback" not in stderr
    run_dir = tmp_path / "runs" / "cut"
    steps = [r["step"] for r in metric_rows(run_dir) if "train/loss" in r]
    assert steps.count(21) == 2 and steps[-1] == 40  # the new round went on from step 20
    assert_bit_identical(straight("2 workers allreduce"), last(run_dir))


def image_read_at(root, step: int, batch: int, workers: int):
    """The train image of the tiny sample's 5 classes that a worker reads for `step` of the
    first epoch (data order is a function of the seed, 0, and the epoch)."""
    train = load_tables(DatasetRoot("copy", str(root)), 5).train
    order = ShardedBatches(len(train), batch, world_size=workers).order()
    return root / train["path"].iloc[order[step * batch * workers]]


def wait_releasing(fifo, process, timeout: float = 120) -> int:
    """Until the driver exits, let go any worker that waits on the FIFO: opening its writing
    end ends the wait and the read fails (a FIFO cannot seek), so that image is skipped.
    Returns the driver's exit code."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        assert time.monotonic() < deadline, "the driver did not finish"
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # ENXIO: nobody waits
            pass
        time.sleep(0.05)
    return process.returncode


def test_checkpoint_interval_saves_mid_epoch_and_keeps_the_newest(tmp_path, tiny_copy,
                                                                  catalog_for):
    # The read of one image of step 6 hangs (as on a hung network filesystem: its path leads
    # to a FIFO) until the driver's timer has asked for a checkpoint, so the save lands
    # mid-epoch however fast the steps are.
    stalled = image_read_at(tiny_copy, step=5, batch=4, workers=2)
    image, fifo = stalled.rename(tmp_path / "image.JPEG"), tmp_path / "stall"
    os.mkfifo(fifo)
    stalled.symlink_to(fifo)
    process = subprocess.Popen(driver(
        "--catalog", str(catalog_for(tiny_copy)), *EXACT, "-b", "4", "--devices", "cpu,cpu",
        "--epochs", "1", "--checkpoint-interval", "0.005", "--keep-checkpoints", "2",
        "-p", "7", "--run-name", "timed"), cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True)
    asked = read_line_with(process, "--checkpoint-interval")
    assert "saving a checkpoint after step" in asked, asked
    assert int(asked.split()[-1]) <= 6  # no worker can finish step 6 before the read ends
    image.replace(stalled)
    assert wait_releasing(fifo, process) == 0, process.stderr.read()
    folder = tmp_path / "runs" / "timed" / "checkpoints"
    kept = sorted(folder.glob("step-*.pt"))
    assert len(kept) == 2 and kept[-1].name == "step-000000020.pt"
    assert (folder / "last.pt").samefile(kept[-1]) and (folder / "best.pt").samefile(kept[-1])
    mid_epoch = checkpoint.load(kept[0])  # a save requested by the driver's timer
    assert 0 < mid_epoch["epoch_step"] < 20 and mid_epoch["step"] == mid_epoch["epoch_step"]
    assert not list(folder.glob(".*"))  # no temporary files left
    # The stalled read, if a loader had begun it before the image came back, failed (a FIFO
    # cannot seek): that image was skipped and listed. It is worker 0's, in steps 1-7.
    run = tmp_path / "runs" / "timed"
    skipped = [row["path"] for row in skipped_rows(run)] if (run / "skipped.tsv").exists() else []
    assert skipped in ([], [str(stalled.relative_to(tiny_copy))]), skipped
    # The save (after step 6 at the latest) fell inside the first print interval, steps 1-7:
    # each interval's images/s still counts all its images (8 a step: worker 0's own count x 2
    # workers) over all its time.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    intervals = [r for r in records if "train/images_per_sec" in r]
    assert [r["progress/epoch_step"] for r in intervals] == [7, 14, 20]
    assert records[-1]["train/images"] == 160 - len(skipped)
    for before, this in zip([{"progress/epoch_step": 0, "progress/epoch_time_s": 0.0}, *intervals],
                            intervals):
        seconds = this["progress/epoch_time_s"] - before["progress/epoch_time_s"]
        images = 8 * (this["progress/epoch_step"] - before["progress/epoch_step"])
        images -= 2 * len(skipped) if before["progress/epoch_step"] == 0 else 0
        assert this["train/images_per_sec"] * seconds == pytest.approx(images, rel=1e-6)


WRITER = """
import sys, time, torch
from app.training import checkpoint

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


@pytest.mark.parametrize("decoder", ["pillow", "dali", "nvjpeg"])
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

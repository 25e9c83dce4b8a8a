"""One rule for a stop, at every moment of a run, whoever sends it, in every mode: the run ends
with 75; where a step was trained since the last checkpoint it is saved first, where none was
(starting, resuming, between restarts) the last checkpoint stands; the message names the
checkpoint that stands, and the record holds each evaluated epoch once.

Each cell is a real driver run (resumed from a 1-epoch checkpoint, so that "the last
checkpoint stands" can be seen) held at its moment (app/runtime/moments.py): the stop signal is
sent while the process (or the replica thread) that reached the moment is held, and it is let
go once the driver has said what it does with the stop (its first line about it), or at once
where the held process is the driver itself. No cell waits on timing: where a race of the
workers decides between two outcomes (a worker held after its step, its peer before or after
reporting its own), both are allowed and each is checked whole.

Moments x modes x senders as a covering set: every moment in the modes where it differs (the
driver's own start is the same for all; restarts exist for processes only), every mode and
every sender at several moments. Mid-epoch stops of every sender, resumed to a bit-identical
end: tests/test_stop_senders.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.parallel.plans import free_port
from app.runtime import moments
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE
from app.training import checkpoint
from conftest import (REPO, TINY_TRAIN_FLAGS, held_in_thread, held_pid, held_pids,
                      read_line_with, release, run_driver)
from test_remote_output import as_checkpoint, bucket_files, new_bucket

BASE_STEPS = 10  # the resumed checkpoint: epoch 1 of 320 images at 2 x 16
RUN = ("--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny", *TINY_TRAIN_FLAGS,
       "-b", "16", "-p", "1", "--stop-timeout", "60")
MODES = {"ps": ("--devices", "cpu,cpu", "--sync", "ps"),
         "allreduce": ("--devices", "cpu,cpu", "--sync", "allreduce"),
         "threads": ("--devices", "cpu,cpu", "--replicas-as", "threads")}
# sender: (signal, to the whole process group (True) or the driver alone)
SENDERS = {"driver SIGTERM": (signal.SIGTERM, False), "group SIGTERM": (signal.SIGTERM, True),
           "Ctrl-C": (signal.SIGINT, True), "group SIGUSR1": (signal.SIGUSR1, True)}
BEFORE_TRAINING = {BASE_STEPS}
AFTER_STEP_11 = {BASE_STEPS, 12}  # held after step 11, before reporting it: ended now, or 12
AFTER_STEP_14 = {14, 15}  # held after 14 before reporting it: its peer reported 13 or 14
EVALUATED_LEFT_OFF = {20}  # epoch 2's steps saved unevaluated
AT_THE_SAVE = {20, 21}  # the epoch's save serves, or (its peer a point ahead) one step more

CELLS = [  # (moment, mode, sender, -j, the steps the stop's checkpoint may hold)
    ("driver:importing", "ps", "driver SIGTERM", 0, BEFORE_TRAINING),
    ("worker:building-model", "allreduce", "group SIGTERM", 1, BEFORE_TRAINING),
    ("worker:building-model", "threads", "Ctrl-C", 0, BEFORE_TRAINING),
    ("worker:resuming", "ps", "group SIGUSR1", 0, BEFORE_TRAINING),
    ("worker:resuming", "threads", "driver SIGTERM", 0, BEFORE_TRAINING),
    ("worker:starting-loaders", "allreduce", "driver SIGTERM", 1, BEFORE_TRAINING),
    ("worker:starting-loaders", "threads", "group SIGTERM", 1, BEFORE_TRAINING),
    ("worker:step-11", "ps", "group SIGTERM", 1, AFTER_STEP_11),
    ("worker:step-11", "threads", "driver SIGTERM", 0, AFTER_STEP_11),
    ("worker:step-14", "allreduce", "Ctrl-C", 0, AFTER_STEP_14),
    ("worker:step-14", "threads", "group SIGUSR1", 0, AFTER_STEP_14),
    ("worker:evaluating", "ps", "group SIGTERM", 1, EVALUATED_LEFT_OFF),
    ("worker:evaluating", "allreduce", "driver SIGTERM", 0, EVALUATED_LEFT_OFF),
    ("worker:evaluating", "threads", "Ctrl-C", 0, EVALUATED_LEFT_OFF),
    ("checkpoint:saving", "ps", "driver SIGTERM", 0, AT_THE_SAVE),
    ("checkpoint:saving", "threads", "group SIGTERM", 0, AT_THE_SAVE),
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """runs/r after one epoch (10 steps) in 2 ps workers: the checkpoint every cell resumes."""
    cwd = tmp_path_factory.mktemp("stop-matrix-base")
    result = run_driver(*RUN, *MODES["ps"], "--epochs", "1", "--run-name", "r", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return cwd / "runs" / "r"


def held_run(tmp_path: Path, base: Path, moment: str, flags: tuple[str, ...],
             command: list[str] | None = None):
    """The base run resumed for 3 epochs, its first process (or replica thread) at `moment`
    held there (`moment*`: every process): the driver process."""
    shutil.copytree(base, tmp_path / "runs" / "r")
    (tmp_path / "moments").mkdir()
    return subprocess.Popen(
        command or [sys.executable, str(REPO / "bin" / "driver.py"), *RUN, "--epochs", "3",
                    "--run-name", "r", "--resume", "auto", *flags],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, moments.PAUSE_AT: moment,
             moments.PAUSE_DIR: str(tmp_path / "moments")},
        start_new_session=True)  # a job's group: the senders to the group reach only it


def send(process, sender: str) -> None:
    signum, to_group = SENDERS[sender]
    if to_group:
        os.killpg(process.pid, signum)
    else:
        os.kill(process.pid, signum)


def epochs_recorded(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["epoch"] for row in rows if "val/top1" in row]


def stopped_at(tmp_path: Path, process, moment: str, sender: str) -> tuple[int, str]:
    """Sends the stop while `process`'s run is held at `moment`; lets the held one go once the
    driver has taken the stop (its first line about it), at once where the driver is the one
    held. (exit code, stderr)."""
    folder = tmp_path / "moments"
    held = held_pid(process, folder, moment)
    driver_held = held == process.pid and not held_in_thread(folder, moment, held)
    send(process, sender)
    taken = ""
    if not driver_held:  # the driver takes the stop first: it saves next, or ends all now
        taken = read_line_with(process, ": saving a checkpoint of the step", "stopped by")
    release(folder, moment, held)
    return process.wait(timeout=180), taken + process.stderr.read()


@pytest.mark.parametrize("moment, mode, sender, loaders, steps", CELLS,
                         ids=[f"{m}-{mode}-{s}" for m, mode, s, _, _ in CELLS])
def test_a_stop_at_any_moment_ends_with_75_and_loses_no_saved_step(
        tmp_path, base, moment, mode, sender, loaders, steps):
    process = held_run(tmp_path, base, moment, (*MODES[mode], "-j", str(loaders)))
    code, stderr = stopped_at(tmp_path, process, moment, sender)
    assert code == PREEMPTED_EXIT_CODE, stderr
    assert "Traceback" not in stderr, stderr
    run_dir = tmp_path / "runs" / "r"
    last = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert last["step"] in steps, stderr
    name = SENDERS[sender][0].name
    if moment == "driver:importing":  # before the arguments are read: no run to name yet
        assert f"stopped by {name} before training began: nothing to save" in stderr, stderr
    else:  # the message names the checkpoint that stands, and how to go on
        assert f"saved runs/r/checkpoints/last.pt after step {last['step']} " in stderr, stderr
        assert "--resume auto --run-name r" in stderr
        assert f"stopped by {name}" in stderr or f"{name}: saving a checkpoint" in stderr
    if last["step"] == BASE_STEPS:  # nothing new: nothing saved, nothing recorded
        assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt")) == \
            sorted(p.name for p in (base / "checkpoints").glob("step-*.pt"))
    # each evaluated epoch recorded once; an epoch saved unevaluated is not among them
    evaluated = last["epoch"]
    assert epochs_recorded(run_dir) == list(range(1, evaluated + 1)), stderr
    if steps == EVALUATED_LEFT_OFF:  # epoch 2 trained, unevaluated
        assert (last["epoch"], last["epoch_step"]) == (1, 10)


# one rank's command, the base run resumed (a launcher gives each rank its variables)
RANK_ARGS = (str(REPO / "bin" / "driver.py"), *RUN, "--epochs", "3", "--run-name", "r",
             "--resume", "auto", "--sync", "allreduce", "--device", "cpu")


def signal_pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits to be delivered to the (stopped) process `pid`."""
    with open(f"/proc/{pid}/status") as handle:
        masks = [int(line.split()[1], 16) for line in handle
                 if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (signum - 1) & 1 for mask in masks)


def wait_until_pending(pids: list[int], signum: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(signal_pending(pid, signum) for pid in pids):
        assert time.monotonic() < deadline, f"{signal.Signals(signum).name} never reached {pids}"
        time.sleep(0.05)


def test_torchruns_agent_passing_a_stop_on_while_the_ranks_resume_ends_each_with_75(
        tmp_path, base):
    """Under torchrun each rank takes the signal itself from its first line: the agent's
    SIGTERM, passed on while both ranks are held as they load the checkpoint, ends each at once
    with 75 (no step trained since it), the checkpoint standing."""
    process = held_run(tmp_path, base, "worker:resuming*", (), [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
        "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *RANK_ARGS])
    ranks = held_pids(process, tmp_path / "moments", "worker:resuming", 2)
    os.kill(process.pid, signal.SIGTERM)  # the agent alone: it passes the signal on
    wait_until_pending(ranks, signal.SIGTERM)
    for pid in ranks:
        release(tmp_path / "moments", "worker:resuming", pid)
    process.wait(timeout=180)  # the agent's own code and traceback (SignalException) are its
    stderr = process.stderr.read()
    assert stderr.count("stopped by SIGTERM at once") == 2, stderr
    assert "lost a peer" not in stderr, stderr
    assert str(REPO / "app") not in stderr and "bin/driver.py\", line" not in stderr, stderr
    run_dir = tmp_path / "runs" / "r"
    assert checkpoint.load(run_dir / "checkpoints" / "last.pt")["step"] == BASE_STEPS
    assert f"saved runs/r/checkpoints/last.pt after step {BASE_STEPS} " in stderr, stderr
    assert epochs_recorded(run_dir) == [1]


def test_a_rank_holding_a_stop_that_loses_its_peer_reports_the_stop_with_75(tmp_path, base):
    """Two ranks as a launcher starts them (its variables), both held after step 12; rank 0
    takes a SIGTERM (it would save at its next point, agreed with its peer) and rank 1 dies
    first: rank 0's collective fails, and it says the stop, not a failure, with 75; the
    resumed checkpoint stands."""
    shutil.copytree(base, tmp_path / "runs" / "r")
    folder = tmp_path / "moments"
    folder.mkdir()
    port = str(free_port())
    ranks = [subprocess.Popen(
        [sys.executable, *RANK_ARGS], cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
             "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
             moments.PAUSE_AT: "worker:step-12*", moments.PAUSE_DIR: str(folder)})
        for rank in (0, 1)]
    held_pids(ranks[0], folder, "worker:step-12", 2)
    os.kill(ranks[0].pid, signal.SIGTERM)
    wait_until_pending([ranks[0].pid], signal.SIGTERM)
    ranks[1].kill()
    ranks[1].wait(timeout=60)
    release(folder, "worker:step-12", ranks[0].pid)
    code, stderr = ranks[0].wait(timeout=120), ranks[0].stderr.read()
    assert code == PREEMPTED_EXIT_CODE, stderr
    assert "stopped by SIGTERM at once: lost a peer" in stderr, stderr
    assert "error:" not in stderr and "Traceback" not in stderr, stderr
    assert checkpoint.load(tmp_path / "runs" / "r" / "checkpoints" / "last.pt")["step"] == \
        BASE_STEPS
    assert f"saved runs/r/checkpoints/last.pt after step {BASE_STEPS} " in stderr, stderr


def test_a_stop_left_off_evaluation_resumes_by_evaluating_that_epoch_once(tmp_path, base):
    """The stop that left an evaluation off saved the epoch's steps; the resume trains nothing
    of that epoch again, evaluates it once and goes on."""
    process = held_run(tmp_path, base, "worker:evaluating", MODES["ps"])
    code, stderr = stopped_at(tmp_path, process, "worker:evaluating", "group SIGTERM")
    assert code == PREEMPTED_EXIT_CODE, stderr
    resumed = run_driver(*RUN, *MODES["ps"], "--epochs", "3", "--run-name", "r", "--resume",
                         "auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    run_dir = tmp_path / "runs" / "r"
    assert epochs_recorded(run_dir) == [1, 2, 3]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [row["step"] for row in rows if "train/loss" in row]
    assert sorted(steps_logged) == list(range(1, 31))  # every step trained and logged once
    assert checkpoint.load(run_dir / "checkpoints" / "last.pt")["step"] == 30


def test_a_stop_between_restarts_ends_with_75_from_the_last_checkpoint(tmp_path, base):
    """A worker killed mid-epoch, the driver waiting to restart the group: a stop there ends
    the run; nothing was saved since the resumed checkpoint, which stands."""
    shutil.copytree(base, tmp_path / "runs" / "r")
    folder = tmp_path / "moments"
    folder.mkdir()
    process = subprocess.Popen(
        [sys.executable, str(REPO / "bin" / "driver.py"), *RUN, *MODES["ps"], "--epochs", "3",
         "--run-name", "r", "--resume", "auto", "--max-restarts", "1"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, moments.PAUSE_AT: "worker:step-13,driver:restart-wait",
             moments.PAUSE_DIR: str(folder)}, start_new_session=True)
    os.kill(held_pid(process, folder, "worker:step-13"), signal.SIGKILL)
    driver = held_pid(process, folder, "driver:restart-wait")
    os.kill(driver, signal.SIGTERM)
    os.kill(driver, signal.SIGCONT)
    code, stderr = process.wait(timeout=120), process.stderr.read()
    assert code == PREEMPTED_EXIT_CODE, stderr
    assert "stopped by SIGTERM before restart 1" in stderr
    assert checkpoint.load(tmp_path / "runs" / "r" / "checkpoints" / "last.pt")["step"] == \
        BASE_STEPS
    assert f"after step {BASE_STEPS} " in stderr and "--resume auto --run-name r" in stderr


def test_a_stop_while_a_checkpoint_uploads_ends_with_the_stops_checkpoint_in_the_bucket(
        s3_server, tmp_path):
    """The upload process held as it puts epoch 1's checkpoint, a worker held after step 12: the
    stop saves step 12 or 13, the uploads get what is left of --stop-timeout, and the bucket
    holds epoch 1's checkpoint and, as last.pt, the stop's, which the message names."""
    bucket = new_bucket(s3_server, "stop-matrix")
    url, env = f"s3://{bucket}/exp", {"AWS_ENDPOINT_URL": s3_server.endpoint}
    folder = tmp_path / "moments"
    folder.mkdir()
    upload, step = f"upload:step-{BASE_STEPS:09d}.pt", "worker:step-12"
    process = subprocess.Popen(
        [sys.executable, str(REPO / "bin" / "driver.py"), *RUN, *MODES["allreduce"],
         "--epochs", "3", "--run-name", "u", "--output-dir", url],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **env, moments.PAUSE_AT: f"{upload},{step}",
             moments.PAUSE_DIR: str(folder)}, start_new_session=True)
    held = [held_pid(process, folder, upload), held_pid(process, folder, step)]
    os.killpg(process.pid, signal.SIGTERM)
    for pid in held:
        os.kill(pid, signal.SIGCONT)
    code, stderr = process.wait(timeout=180), process.stderr.read()
    assert code == PREEMPTED_EXIT_CODE, stderr
    files = bucket_files(s3_server, bucket)
    stop = as_checkpoint(files["exp/u/checkpoints/last.pt"])
    assert stop["step"] in (12, 13) and f"exp/u/checkpoints/step-{BASE_STEPS:09d}.pt" in files
    assert f"saved {url}/u/checkpoints/last.pt (a copy of step-{stop['step']:09d}.pt) after " \
           f"step {stop['step']} " in stderr, stderr

"""No process's death hangs a run, whenever it dies: each kind of process of a real driver run
(the driver, the forkserver, a worker, the parameter server, a loader process) is SIGKILLed at
each moment of its start and of its work, as the out-of-memory killer would. The moments are
exact: the process is held there (app/runtime/moments.py) until it is killed. Then the driver
ends (non-zero, one line naming the process) within the bound tests/test_parallel.py holds for
a worker killed mid-epoch, or, with --max-restarts, the run starts again and finishes; and no
process of the run is left.

A worker or the server killed mid-epoch: tests/test_parallel.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from app.runtime import moments
from conftest import held_pid, processes_with, read_started_line, start_driver, wait_for_training

KILL_TO_EXIT_S = 3.0  # tests/test_parallel.py's bound for a worker killed mid-epoch
GONE_S = 3.0  # a process of a killed driver, from the kill to its end


def held_at(tmp_path: Path, moment: str, *flags: str):
    """A driver run (2 CPU workers, ps, one loader process each) whose first process to reach
    `moment` stops there; returns (driver, its marker, the held process's pid)."""
    folder = tmp_path / "moments"
    folder.mkdir()
    process, marker = start_driver(tmp_path, "--sync", "ps", "-j", "1", *flags, env={
        moments.PAUSE_AT: moment, moments.PAUSE_DIR: str(folder)})
    return process, marker, held_pid(process, folder, moment)


def forkserver_of(marker: str, driver: int) -> int:
    """The forkserver: the driver's child that runs `multiprocessing.forkserver`."""
    for pid in processes_with(marker):
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if b"forkserver" in handle.read() and parent_of(pid) == driver:
                return pid
    raise AssertionError("no forkserver found")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def ends_with_one_line(process, marker: str, killed_at: float, names: str) -> str:
    code = process.wait(timeout=60)
    ended_at = time.monotonic()
    stderr = process.stderr.read()
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 1, stderr
    assert len(errors) == 1 and names in errors[0], stderr
    assert "Traceback" not in "\n".join(errors)
    assert ended_at - killed_at < KILL_TO_EXIT_S, stderr
    assert all_gone(marker)
    return errors[0]


def all_gone(marker: str, within: float = GONE_S) -> bool:
    deadline = time.monotonic() + within
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return processes_with(marker) == []


@pytest.mark.parametrize("moment, victim", [
    ("worker:start", "worker 0 (cpu)"),
    ("worker:first-batch", "worker 0 (cpu)"),
    ("server:start", "parameter server (cpu)"),
    ("server:registered", "parameter server (cpu)")])
def test_a_worker_or_the_server_killed_while_starting_ends_the_run(tmp_path, moment, victim):
    process, marker, pid = held_at(tmp_path, moment)
    name = next(name for name, found in worker_pids_of(process).items() if found == pid)
    os.kill(pid, signal.SIGKILL)
    line = ends_with_one_line(process, marker, time.monotonic(), name)
    assert line == f"error: {name} was killed by SIGKILL (by a user or the out-of-memory " \
                   "killer); stopped the other processes"
    assert name.startswith(victim.split(" ")[0])


def worker_pids_of(process) -> dict[str, int]:
    from conftest import worker_pids  # noqa: PLC0415
    return worker_pids(read_started_line(process))


@pytest.mark.parametrize("moment", ["loader:start", "loader:batch", "work"])
def test_a_loader_process_killed_at_any_moment_ends_the_run_naming_it(tmp_path, moment):
    """A loader is forked from its worker and dies with it; killed, its worker fails at once
    (DataLoader's SIGCHLD handler), naming it."""
    if moment == "work":
        process, marker = start_driver(tmp_path, "--sync", "ps", "-j", "1")
        workers = worker_pids_of(process)
        wait_for_training(tmp_path, process)
        pid = next(p for w in workers.values() for p in children_of(w))
    else:
        process, marker, pid = held_at(tmp_path, moment)
    os.kill(pid, signal.SIGKILL)
    line = ends_with_one_line(process, marker, time.monotonic(), f"pid {pid}")
    assert "loader process" in line and "killed by SIGKILL" in line


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return [int(child) for child in handle.read().split()]


def test_a_loader_killed_as_it_starts_is_replaced_with_its_group_under_max_restarts(tmp_path):
    process, marker, pid = held_at(tmp_path, "loader:start", "--epochs", "1",
                                   "--max-restarts", "1")
    os.kill(pid, signal.SIGKILL)
    assert process.wait(timeout=120) == 0
    stderr = process.stderr.read()
    assert "restart 1 of 1" in stderr and f"pid {pid}" in stderr
    assert (tmp_path / "runs" / "long" / "checkpoints" / "last.pt").is_file()
    assert all_gone(marker)


@pytest.mark.parametrize("moment", ["driver:launch", "driver:started", "work"])
def test_a_killed_driver_leaves_no_process_behind(tmp_path, moment):
    """driver:launch: the forkserver is still importing; driver:started: every process was
    just started; work: mid-epoch, loader processes running."""
    if moment == "work":
        process, marker = start_driver(tmp_path, "--sync", "ps", "-j", "1")
        wait_for_training(tmp_path, process)
        pid = process.pid
    else:
        process, marker, pid = held_at(tmp_path, moment)
    assert pid == process.pid
    assert len(processes_with(marker)) >= 2  # the driver and its forkserver at least
    os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert all_gone(marker)


def test_a_forkserver_killed_while_it_imports_ends_the_run_naming_it(tmp_path):
    process, marker, pid = held_at(tmp_path, "driver:launch")
    os.kill(forkserver_of(marker, pid), signal.SIGKILL)
    os.kill(pid, signal.SIGCONT)
    line = ends_with_one_line(process, marker, time.monotonic(), "forkserver")
    assert "died while it imported" in line


def test_a_forkserver_killed_mid_epoch_ends_the_run_and_every_process_with_it(tmp_path):
    process, marker = start_driver(tmp_path, "--sync", "ps", "-j", "1")
    wait_for_training(tmp_path, process)
    os.kill(forkserver_of(marker, process.pid), signal.SIGKILL)
    line = ends_with_one_line(process, marker, time.monotonic(), "forkserver")
    assert "process(es) with it" in line

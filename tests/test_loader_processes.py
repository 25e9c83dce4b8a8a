"""A worker's loader processes (app/data/loader_processes.py), in a process of their own as in
a worker: one killed from outside is named within a step of the wait for a batch; those the
worker kills itself after a failure are neither reported by the DataLoader (its SIGCHLD handler
raises wherever the process is) nor taken for the failure's cause.

Real runs: tests/test_process_deaths.py kills a loader process at each moment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import os, signal, time
from torch.utils.data import Dataset
from app.data import loader_processes as loaders

class FirstTwo(Dataset):  # the rest never comes
    def __len__(self): return 64
    def __getitem__(self, index):
        if index >= 2:
            time.sleep(60)
        return index

def started():
    loader = loaders.data_loader(FirstTwo(), 2, uses_obstore=False, batch_size=1)
    batches = iter(loader)
    loaders.remember_processes(loader)
    next(batches)
    return loader, batches

loader, batches = started()
loaders.kill_processes(loader)
time.sleep(1)  # their SIGCHLDs come meanwhile
print("killed:", loaders.dead_loader())

loader, batches = started()
victim = loaders.private_api.loader_processes(loader)[0].pid
killed = time.monotonic()
os.kill(victim, signal.SIGKILL)
try:
    while True:
        next(batches)
except RuntimeError as error:
    print(f"{time.monotonic() - killed:.1f}", victim, loaders.loader_death(error), sep="|")
os._exit(0)
"""


def test_a_killed_loader_process_is_named_and_those_killed_after_a_failure_are_not():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=120)
    assert done.returncode == 0, done.stderr
    killed, named = done.stdout.splitlines()
    assert killed == "killed: None"
    assert "Traceback" not in done.stderr  # no error of the DataLoader's for the killed ones
    seconds, victim, line = named.split("|")
    assert float(seconds) < 1.5
    assert line == f"its loader process (pid {victim}) was killed by SIGKILL (by a user or " \
                   "the out-of-memory killer)"


def test_torchs_line_for_a_dead_loader_is_told_as_it_says_even_inside_another_error():
    """The DataLoader's SIGCHLD handler can interrupt a wait for a peer, whose error then carries
    its line; by then the process may be reaped and its object collected."""
    from app.data import loader_processes as loaders
    wrapped = RuntimeError("could not receive the 'avg' from the parameter server: RuntimeError: "
                           "DataLoader worker (pid 4242) is killed by signal: Killed.")
    exited = RuntimeError("DataLoader worker (pid 4343) exited unexpectedly with exit code 3. "
                          "Details are lost due to multiprocessing.")
    assert loaders.loader_death(wrapped) == "its loader process (pid 4242) was killed by " \
        "SIGKILL (by a user or the out-of-memory killer)"
    assert loaders.loader_death(exited) == "its loader process (pid 4343) exited with code 3"
    assert loaders.loader_death(RuntimeError("Connection closed by peer")) is None


ORPHANED = """
import multiprocessing, os, sys, time
from app.runtime.liveness import die_with_parent

def child(parent):
    deadline = time.monotonic() + 60
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)  # until the parent is gone, as a loader process that starts late
    print("orphaned", flush=True)
    die_with_parent()
    print("survived", flush=True)

multiprocessing.get_context("fork").Process(target=child, args=(os.getpid(),)).start()
os._exit(0)
"""


def test_a_process_whose_parent_died_before_it_asked_to_die_with_it_dies_at_once():
    """A loader process that reached its init after its worker had died (a busy machine) was
    left running, holding the worker's output pipes: now it dies at once."""
    done = subprocess.run([sys.executable, "-c", ORPHANED], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=120)
    assert done.stdout.split() == ["orphaned"], done.stderr  # the pipe closes as it dies

"""The loader processes of a DataLoader: how they start, that they die with their worker, and
how the worker tells of one that died.

Forked from their worker (`start_method`), they start in milliseconds with its imports and
table, nothing pickled; spawned only where they read through obstore and the worker runs its
threads, which a fork would break (app/runtime/fork_safety.py). A dead one is noticed within
LIVENESS_POLL_S of a wait for a batch and told in one line naming it and how it ended,
whatever error the DataLoader raised.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from multiprocessing.process import BaseProcess

from torch.utils.data import DataLoader, Dataset

from app.runtime import private_api
from app.runtime.fork_safety import threads_fork_breaks
from app.runtime.stop_signals import ignore_in_child
from app.runtime.liveness import die_with_parent, is_alive
from app.runtime.moments import moment

log = logging.getLogger("imagenet_dp")
# How often a wait for a batch checks that the loader processes live: torch's SIGCHLD handler
# tells only the main thread, and not where its error lands in a __del__ or an at-fork handler
# (filelock's); torch's own check comes every 5 s.
LIVENESS_POLL_S = 0.5
# How long a failing worker looks for the loader that died and how it ended: a killed one ends
# thread by thread, so the DataLoader may raise before its end can be read (waitid).
DEATH_READABLE_S = 2.0


def data_loader(dataset: Dataset, workers: int, uses_obstore: bool, **options) -> DataLoader:
    loader_type = private_api.loader_polling_every(LIVENESS_POLL_S)
    return loader_type(dataset, num_workers=workers, persistent_workers=workers > 0,
                       multiprocessing_context=start_method(uses_obstore) if workers else None,
                       worker_init_fn=loader_init, **options)


def start_method(uses_obstore: bool = True) -> str:
    """Fork (the table's pages stay shared), unless a fork breaks a thread this process runs
    that the loaders need: only loaders that read through obstore need its runtime."""
    broken = threads_fork_breaks() if uses_obstore else []
    if broken:
        log.info("loader processes are spawned, not forked: this process runs %s threads",
                 broken[0])
        return "spawn"
    return "fork"


def loader_init(index: int) -> None:
    """DataLoader's worker_init_fn: die with the worker at once (torch's check takes up to
    5 s), and leave the stop signals to it (forked with them blocked: start_loaders)."""
    die_with_parent()
    ignore_in_child()
    moment("loader:start")


# This process's loader processes by pid; how those that died ended (read as each dies: its
# multiprocessing object may never learn it); those it killed itself, whose deaths are no failure.
_started: weakref.WeakValueDictionary[int, BaseProcess] = weakref.WeakValueDictionary()
_ended: dict[int, os.waitid_result] = {}
_killed: set[int] = set()


def remember_processes(loader: DataLoader) -> None:
    for process in private_api.loader_processes(loader):
        _started[process.pid] = process
    if threading.current_thread() is threading.main_thread():
        record_deaths()


def record_deaths() -> None:
    """A SIGCHLD handler in front of the DataLoader's (which raises wherever this process is):
    it notes how a loader process ended, without reaping it, and keeps from the DataLoader's
    the deaths this process caused (`kill_processes`), which it would raise as failures."""
    previous = signal.getsignal(signal.SIGCHLD)
    if getattr(previous, "records_loader_deaths", False):
        return

    def handler(signum, frame) -> None:
        killed = failed = False
        for pid in list(_started):
            ended = peek_ended(pid)
            if ended is not None:
                _ended.setdefault(pid, ended)
                killed |= pid in _killed
                failed |= pid not in _killed and (ended.si_code, ended.si_status) != (
                    os.CLD_EXITED, 0)
        if callable(previous) and (failed or not killed):
            previous(signum, frame)
    handler.records_loader_deaths = True
    signal.signal(signal.SIGCHLD, handler)


class LoaderProcessDied(RuntimeError):
    """A loader process died while its batch was on its way (its pipe or shared memory broke)."""


def loader_death(error: BaseException) -> str | None:
    """One line for the loader process's death behind `error` (the DataLoader's, ours, or one
    that carries either in its message); None: none died (but those this process killed)."""
    if isinstance(error, LoaderProcessDied):
        return str(error)
    told = private_api.loader_death_told(error)
    if told and told[0] not in _killed:
        return death_line(*told)
    # Only an error naming a DataLoader worker waits for its death to be readable: any other
    # (a lost peer) is told at once, before a launcher that saw the peer die ends this one.
    return dead_loader(wait_s=DEATH_READABLE_S if private_api.names_a_loader(error) else 0.0)


def describe_death(process: BaseProcess, deadline: float = 0.0) -> str:
    code = process.exitcode
    ended = _ended.get(process.pid) or peek_ended(process.pid)
    while code is None and ended is None and time.monotonic() < deadline:
        time.sleep(0.01)  # a zombie leader whose other threads still exit: not yet readable
        code, ended = process.exitcode, _ended.get(process.pid) or peek_ended(process.pid)
    if code is None and ended is not None:
        code = -ended.si_status if ended.si_code in (os.CLD_KILLED, os.CLD_DUMPED) \
            else ended.si_status
    return death_line(process.pid, code)


def death_line(pid: int, code: int | None) -> str:
    """`code`: an exit code, minus the signal that killed it, or None where it is not known."""
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
        how += " (by a user or the out-of-memory killer)" if -code == signal.SIGKILL else ""
    else:
        how = "ended" if code is None else f"exited with code {code}"
    return f"its loader process (pid {pid}) {how}"


def peek_ended(pid: int) -> os.waitid_result | None:
    """How a dead child ended, without reaping it (the SIGCHLD handler may not have run yet)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (or not our child): its cause is lost
        return None


def dead_loader(wait_s: float = 0.0) -> str | None:
    """How the first of this process's loader processes that died ended (None: none died, but
    those it killed); a death still under way is waited for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        for process in list(_started.values()):
            if process.pid in _killed:
                continue
            if process.exitcode not in (None, 0) or not is_alive(process.pid):
                return describe_death(process, deadline)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def kill_processes(loader: DataLoader | None) -> None:
    """End `loader`'s processes at once (after a failure); one already dead keeps its cause."""
    for process in private_api.loader_processes(loader):
        if process.exitcode is None:
            _killed.add(process.pid)
            process.kill()

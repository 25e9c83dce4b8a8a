"""The loader processes of a DataLoader: how they start, that they die with their worker, and
how the worker tells of one that died.

They are forked from their worker (`start_method`): as pytorch/examples' loaders, they start in
milliseconds with the worker's imports and its table, nothing pickled, side by side. Spawned
only where the worker runs threads a fork would break (app/runtime/fork_safety.py). Each dies
with its worker (`loader_init`). A dead one is noticed within LIVENESS_POLL_S of a wait for a
batch (`WatchfulLoader`), and told in one line naming it and how it ended, whichever way the
DataLoader reports it (`loader_death`, `dead_loader`).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import weakref
from multiprocessing.process import BaseProcess

from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from app.runtime.fork_safety import threads_fork_breaks
from app.runtime.interrupts import ignore_stop_signals
from app.runtime.liveness import die_with_parent, is_alive
from app.runtime.moments import moment

log = logging.getLogger("imagenet_dp")
LIVENESS_POLL_S = 0.5  # how often a wait for a batch checks that the loader processes live


class WatchfulIterator(_MultiProcessingDataLoaderIter):
    """torch's iterator over its loader processes, waiting for a batch in steps of
    LIVENESS_POLL_S instead of 5 s: after each it checks that its processes live. Its other
    check, an error raised by its SIGCHLD handler in whatever code runs at that moment, is
    lost where that code is a __del__ or an at-fork handler (seen here: filelock's); then a
    dead loader process was noticed only 5 s later."""

    def _try_get_data(self, timeout: float = LIVENESS_POLL_S):
        return super()._try_get_data(timeout)


class WatchfulLoader(DataLoader):
    """A DataLoader whose iterator is WatchfulIterator."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        self.check_worker_number_rationality()
        return WatchfulIterator(self)


def start_method() -> str:
    """Fork: a loader process starts in milliseconds with this process's imports and the
    dataset's table (nothing is pickled to it; the table's paths are fixed-width bytes, so the
    pages stay shared), and the processes start side by side. Spawn only where a fork is known
    to break something this process runs (app/runtime/fork_safety.py): each process then
    imports and unpickles its dataset, one after another."""
    broken = threads_fork_breaks()
    if broken:
        log.info("loader processes are spawned, not forked: this process runs %s threads",
                 broken[0])
        return "spawn"
    return "fork"


# How torch's DataLoader says that one of its processes died: from its SIGCHLD handler ("is
# killed by signal: Killed", "exited unexpectedly with exit_code 1") or from its wait for a batch
LOADER_DIED = re.compile(r"DataLoader worker \(pid\(?s?\)? ([\d, ]+)\) (?:is killed by signal: "
                         r"([^.]+)|exited unexpectedly(?: with exit_code (-?\d+))?)")
SIGNAL_NAMES = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}


# This process's loader processes by pid, and how those that died ended (os.waitid's answer,
# read as each dies: whoever reaps it later, its multiprocessing object may never learn it)
_started: weakref.WeakValueDictionary[int, BaseProcess] = weakref.WeakValueDictionary()
_ended: dict[int, os.waitid_result] = {}


def remember_processes(loader: DataLoader) -> None:
    for process in getattr(getattr(loader, "_iterator", None), "_workers", []):
        _started[process.pid] = process
    if threading.current_thread() is threading.main_thread():
        record_deaths()


def record_deaths() -> None:
    """A SIGCHLD handler in front of the DataLoader's (which raises its error wherever this
    process is): it first notes how a loader process ended, without reaping it."""
    previous = signal.getsignal(signal.SIGCHLD)
    if getattr(previous, "records_loader_deaths", False):
        return

    def handler(signum, frame) -> None:
        for pid in list(_started):
            try:
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue
            if ended is not None:
                _ended.setdefault(pid, ended)
        if callable(previous):
            previous(signum, frame)
    handler.records_loader_deaths = True
    signal.signal(signal.SIGCHLD, handler)


class LoaderProcessDied(RuntimeError):
    """A loader process died while its batch was on its way (the pipe or the shared memory it
    was handing over broke): the message says which process and how it ended."""


def loader_death(error: BaseException) -> str | None:
    """One line for a loader process's death, from the DataLoader's error (its SIGCHLD handler
    interrupts whatever this process does) or ours (None: another error)."""
    if isinstance(error, LoaderProcessDied):
        return str(error)
    found = LOADER_DIED.search(str(error))
    if not found:
        return None
    pids, by_signal, code = found.groups()
    process = _started.get(int(pids.split(",")[0]))
    if by_signal is None and code is None and process is not None:
        return describe_death(process)
    how = f"was killed by {SIGNAL_NAMES.get(by_signal.strip(), by_signal.strip())}" \
        if by_signal else f"exited with code {code}" if code is not None else "exited"
    if by_signal and by_signal.strip() == signal.strsignal(signal.SIGKILL):
        how += " (by a user or the out-of-memory killer)"
    return f"its loader process (pid {pids.strip()}) {how}"


def describe_death(process: BaseProcess) -> str:
    code = process.exitcode
    ended = _ended.get(process.pid)
    if code is None and ended is not None:
        code = -ended.si_status if ended.si_code in (os.CLD_KILLED, os.CLD_DUMPED) \
            else ended.si_status
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
        how += " (by a user or the out-of-memory killer)" if -code == signal.SIGKILL else ""
    else:
        how = "ended" if code is None else f"exited with code {code}"
    return f"its loader process (pid {process.pid}) {how}"


def dead_loader() -> str | None:
    """How the first of this process's loader processes that died ended (None: none died).
    Its exit code where multiprocessing has it; else it is gone from /proc (reaped already)."""
    for process in list(_started.values()):
        if process.exitcode not in (None, 0) or not is_alive(process.pid):
            return describe_death(process)
    return None


def loader_init(index: int) -> None:
    """First thing in each loader process (DataLoader's worker_init_fn): it dies with its
    worker at once (torch's own check notices a dead parent only within 5 s), and leaves the
    stop signals to it."""
    die_with_parent()
    ignore_stop_signals()
    moment("loader:start")


def kill_processes(loader: DataLoader | None) -> None:
    """End `loader`'s processes at once (after a failure), unregistered first from the
    DataLoader's SIGCHLD check, which would take their deaths for a failure of their own."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is None:
        return
    if getattr(iterator, "_worker_pids_set", False):
        signal_handling._remove_worker_pids(id(iterator))  # noqa: SLF001
        iterator._worker_pids_set = False  # noqa: SLF001
    for process in getattr(iterator, "_workers", []):
        process.kill()

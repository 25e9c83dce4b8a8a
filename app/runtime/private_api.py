"""Every private name of Python and torch that this program uses, each where no public way does
the job, so that a release that moves one breaks here and in tests/test_private_api.py, which
checks each name and the shape used (attributes, parameters), rather than somewhere in a run.

Imports nothing of app/, and torch only when a loader is asked for: the driver stays light.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import re
import signal
from multiprocessing import forkserver
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterator


def forkserver_pid() -> int | None:
    """The pid of the forkserver this process started (None: none yet). Python keeps it on the
    module's private ForkServer instance: `multiprocessing.forkserver` exposes ensure_running
    and set_forkserver_preload only, and the server is no Process that active_children lists."""
    return forkserver._forkserver._forkserver_pid  # noqa: SLF001


@contextlib.contextmanager
def forkserver_restart_refused(instead: Callable[[], None]) -> Iterator[None]:
    """Meanwhile, starting a process calls `instead` (which raises where the server died) where
    Python would call ensure_running, which starts a new server, without a word and after its
    imports, where it finds the old one dead (even one killed a moment before and still
    tearing down, so no check beforehand closes the gap). No public switch: each start calls
    the method of the module's private ForkServer instance, which this shadows."""
    server = forkserver._forkserver  # noqa: SLF001
    server.ensure_running = instead
    try:
        yield
    finally:
        del server.ensure_running


class PassedFd:
    """An open file descriptor of the process that starts a child, opened in the child as it
    starts (an int there). multiprocessing sends it along with the child's arguments, through
    the forkserver's socket, as it does its own pipes and locks: `reduction.DupFd`, which its
    documentation does not name; no public way hands a child of the server our descriptors."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction  # noqa: PLC0415
        return (_opened_in_child, (reduction.DupFd(self.fd),))


def _opened_in_child(passed: Any) -> int:
    return passed.detach()


def run_exit_handlers() -> None:
    """What sys.exit would run (atexit's handlers, last registered first), for a process that
    then ends with os._exit: atexit registers and unregisters, but runs them only at exit."""
    atexit._run_exitfuncs()  # noqa: SLF001


def loader_processes(loader: Any) -> list[BaseProcess]:
    """The processes of a torch DataLoader with persistent workers (none before its first
    pass). It keeps them on its private iterator; multiprocessing.active_children() lists them
    too, but reaps and drops one that died already: one killed as it starts would go unnamed."""
    return list(getattr(getattr(loader, "_iterator", None), "_workers", []))


@functools.cache
def loader_polling_every(seconds: float) -> type:
    """torch's DataLoader, whose wait for a batch checks every `seconds` (torch: every 5 s) that
    its processes live. Torch has no public setting for it: the interval is the default of its
    private iterator's `_try_get_data(timeout)`; the public `timeout` ends the wait with an
    error instead, and a persistent loader's resumption at each epoch's start is such a wait."""
    from torch.utils.data import DataLoader  # noqa: PLC0415 (only where a loader is built)
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter  # noqa: PLC0415

    class PollingIterator(_MultiProcessingDataLoaderIter):
        def _try_get_data(self, timeout: float = seconds):
            return super()._try_get_data(timeout)

    class PollingLoader(DataLoader):
        def _get_iterator(self):
            if self.num_workers == 0:
                return super()._get_iterator()
            self.check_worker_number_rationality()
            return PollingIterator(self)

    return PollingLoader


# torch's words for a loader process that its SIGCHLD handler saw die (torch/csrc/DataLoader.cpp).
_TORCH_SAYS_DIED = re.compile(
    r"DataLoader worker \(pid (?P<pid>\d+)\) (?:is killed by signal: (?P<signal>[^.]+)\.|"
    r"exited unexpectedly with exit code (?P<code>-?\d+))")
_SIGNALS_BY_DESCRIPTION = {signal.strsignal(number): number for number in signal.Signals}


def loader_death_told(error: BaseException) -> tuple[int, int | None] | None:
    """The pid and the exit code (minus the signal that killed it; None: a signal with no
    name) of the loader process that torch's `error` names, in its message (also quoted in
    another error's) or in its cause's (torch's wait raises "exited unexpectedly" from it);
    None where it names none. Read from torch's text, which is no API: by the time the error is
    handled, the process may be reaped and its object collected, and torch exposes the pid and
    the cause nowhere else."""
    told = None
    while error is not None and told is None:
        told = _TORCH_SAYS_DIED.search(str(error))
        error = error.__cause__ or error.__context__
    if told is None:
        return None
    if told["code"] is not None:
        return int(told["pid"]), int(told["code"])
    number = _SIGNALS_BY_DESCRIPTION.get(told["signal"])
    return int(told["pid"]), -number if number else None


def names_a_loader(error: BaseException) -> bool:
    """Whether torch's `error` is about one of its loader processes, told or not how it ended
    ("exited unexpectedly", from its wait)."""
    return "DataLoader worker (pid" in str(error)

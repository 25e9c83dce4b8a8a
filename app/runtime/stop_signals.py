"""This process's stop signals (SIGINT, SIGTERM, SIGUSR1): one handler for the life of the
process, from the first line of bin/driver.py on (or, from Python, for the time of a training
call), so that no moment of a run takes a signal's default action.

A signal is a request to stop; what it does depends on what the process is doing, which the
process says by `raising_from`:
- nothing to save yet (the run starting: imports, the dataset, the model, a resume, the
  loaders; between restarts): a request raises StopRequested at once, and the run ends with 75
  with its last checkpoint standing (`raising_from(1)`);
- a supervisor (the driver's loop over its workers, or over its replica threads) looks at the
  request itself, between its waits (`raising_from(0)`; `wakeup` wakes it);
- a worker that polls for requests between steps takes the first request there, and a second
  one, the person who means it, raises at once (`raising_from(2)`).

Signals reach a process, not an object: one StopSignals a process (`stop_signals()`).
Children that must not act on them (the forkserver, loaders, the upload process) start with
them blocked (`blocked()`), then ignore and unblock them (`ignore_in_child`)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, Iterator

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request; resume to go on
# SIGUSR1 (Slurm's `--signal=USR1@SECONDS`) means what a preemption's SIGTERM does: save, stop.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# One request may reach a process twice within milliseconds (slurmstepd signals every process
# of the step, and srun or torchrun forwards its own): only a later signal is a second one.
REPEAT_WINDOW_S = 1.0


class StopRequested(BaseException):
    """A stop request that ends what this process does at once (a BaseException, as
    KeyboardInterrupt: no `except Exception` holds it up)."""

    def __init__(self, signum: int, requests: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum, self.requests = signum, requests

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class StopSignals:
    def __init__(self) -> None:
        self.received: int | None = None  # the first request's signal
        self.first_at: float | None = None  # when it came (time.monotonic())
        self.requests = 0  # requests so far (a repeat within REPEAT_WINDOW_S is the same one)
        self.raise_from = 1  # the request that raises StopRequested (0: none does)
        self._last_at = 0.0
        self.wakeup, self._notify = os.pipe()
        for fd in (self.wakeup, self._notify):
            os.set_blocking(fd, False)
        self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}

    def handle(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if self.requests and now - self._last_at <= REPEAT_WINDOW_S:
            return  # the same request again
        self._last_at = now
        self.requests += 1
        if self.received is None:
            self.received, self.first_at = signum, now
        with contextlib.suppress(BlockingIOError):  # full of earlier wake-ups: awake anyway
            os.write(self._notify, b"!")
        self.raise_if_due()

    def raise_if_due(self) -> None:
        if self.raise_from and self.requests >= self.raise_from:
            raise StopRequested(self.received, self.requests)

    @contextlib.contextmanager
    def raising_from(self, request: int) -> Iterator[None]:
        """Within: the `request`-th stop request (and any later) raises StopRequested, at once
        if it has come already; 0: none raises."""
        previous, self.raise_from = self.raise_from, request
        try:
            self.raise_if_due()
            yield
        finally:
            self.raise_from = previous

    def clear_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wakeup, 512):
                pass

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def since_first_s(self) -> float | None:
        """How long ago the first request came (None: none came)."""
        return None if self.first_at is None else time.monotonic() - self.first_at

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        os.close(self.wakeup)
        os.close(self._notify)


_THIS_PROCESS: list[StopSignals] = []


def stop_signals() -> StopSignals | None:
    """This process's StopSignals, its handlers installed on the first call; None in a thread
    other than the main one, where Python cannot install them (a notebook's helper thread):
    there the caller's own handling stays."""
    if not _THIS_PROCESS:
        if threading.current_thread() is not threading.main_thread():
            return None
        _THIS_PROCESS.append(StopSignals())
    return _THIS_PROCESS[0]


def raising_from(request: int) -> contextlib.AbstractContextManager:
    """StopSignals.raising_from for this process's signals, where it has them."""
    signals = stop_signals()
    return signals.raising_from(request) if signals else contextlib.nullcontext()


@contextlib.contextmanager
def caught_for_a_call() -> Iterator[StopSignals | None]:
    """For a training call from Python: this process's handlers for its time, the caller's
    (a notebook's KeyboardInterrupt) before and after it. A process that installed them for
    its life (bin/driver.py) keeps them."""
    installed_here = not _THIS_PROCESS
    signals = stop_signals()
    try:
        yield signals
    finally:
        if installed_here and signals is not None:
            _THIS_PROCESS.clear()
            signals.restore()


def seconds_since_stop_signal() -> float | None:
    """How long ago this process's first stop request came (None: none came)."""
    return _THIS_PROCESS[0].since_first_s() if _THIS_PROCESS else None


def ignore_stop_signals(*_: object) -> None:
    """In a process whose stop is its parent's business (a loader: Slurm signals every process
    of a job step, and a loader killed by one would fail the worker's next batch before it has
    saved). Also a DataLoader worker_init_fn: it is called with the loader's index."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def ignore_in_child(*_: object) -> None:
    """The first thing of a child started under `blocked()`: ignore, then unblock (a signal
    that came meanwhile, pending, is dropped: the parent got it too)."""
    ignore_stop_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Around starting a child that must never act on a stop signal: it inherits them blocked
    (across fork and exec), so no moment of its start takes their default action, until it
    ignores them (`ignore_in_child`). Blocked, not ignored: one that reaches this process
    meanwhile is delivered once this ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

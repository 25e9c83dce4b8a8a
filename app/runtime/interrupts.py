"""Saving and stopping at a step every worker agrees on.

A signal (SIGTERM from a scheduler, SIGUSR1 before Slurm's time limit, Ctrl-C) or the
--checkpoint-interval timer asks for a checkpoint, which every worker must save at the same
step: it gathers state from all of them. Two ways to agree:

- SharedRequests (the driver spawned the workers): each worker publishes every finished step in
  shared memory; the driver, under the same lock, names the step after which everyone saves:
  one past the furthest worker. Workers are never more than one step apart (each step needs
  every worker's gradients), so nobody has passed it.
- AgreedRequests (one process, or a launcher with no driver above the workers): each process
  notices its own signals and timer, and the workers combine their wishes every step.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Protocol

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; resume to go on
# SIGUSR1 (Slurm's `--signal=USR1@SECONDS`) means what a preemption's SIGTERM does: save, stop.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# One request may reach a process twice within milliseconds (slurmstepd signals every process
# of the step, and srun or torchrun forwards its own): only a later signal is a second one.
REPEAT_WINDOW_S = 1.0


# When this process got its first stop signal (time.monotonic()), which --stop-timeout counts
# from (the checkpoint, then its upload). Signals reach a process, not an object: a global.
_FIRST_STOP_SIGNAL: list[float] = []


def note_stop_signal() -> None:
    """Called by every stop-signal handler of this process."""
    if not _FIRST_STOP_SIGNAL:
        _FIRST_STOP_SIGNAL.append(time.monotonic())


def seconds_since_stop_signal() -> float | None:
    """How long ago the first stop signal came (None: none came)."""
    return time.monotonic() - _FIRST_STOP_SIGNAL[0] if _FIRST_STOP_SIGNAL else None


def ignore_stop_signals(*_: object) -> None:
    """In a loader process: Slurm signals every process of a job step, and a loader killed by
    them would fail the worker's next batch before it has saved; the worker stops its loaders
    itself. (Also a DataLoader worker_init_fn: it is called with the loader's index.)"""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


@dataclass(frozen=True)
class Action:
    save: bool = False
    stop: bool = False  # implies save


class Requests(Protocol):
    def poll(self, rank: int, step: int) -> Action:
        """Called by every worker after every step (and once before the first)."""


class NoRequests:
    def poll(self, rank: int, step: int) -> Action:
        return Action()


class Interval:
    """Due every `minutes` (never for 0)."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60
        self.last = time.monotonic()

    def due(self) -> bool:
        if self.seconds <= 0 or time.monotonic() - self.last < self.seconds:
            return False
        self.last = time.monotonic()
        return True


class SharedRequests:
    """Made by the driver before it spawns the workers; passed to each of them."""

    NOT_STARTED = -1

    def __init__(self, context: Any, world_size: int):
        self.lock = context.Lock()
        self.finished = context.RawArray("q", [self.NOT_STARTED] * world_size)
        self.save_at = context.RawValue("q", -1)
        self.stop_at = context.RawValue("q", -1)

    # --- driver side ---
    def ask(self, stop: bool) -> int | None:
        """Schedule a save (and a stop); returns the step, or None when the workers have not
        all started training yet (nothing new to save) or a save is still pending."""
        with self.lock:
            finished = list(self.finished)
            if min(finished) == self.NOT_STARTED:
                return None
            if stop:
                if self.stop_at.value < 0:
                    self.stop_at.value = max(finished) + 1
                return self.stop_at.value
            if self.save_at.value > min(finished) or self.stop_at.value >= 0:
                return None  # the previous save has not happened everywhere yet
            self.save_at.value = max(finished) + 1
            return self.save_at.value

    # --- worker side ---
    def poll(self, rank: int, step: int) -> Action:
        with self.lock:
            self.finished[rank] = step
            save_at, stop_at = self.save_at.value, self.stop_at.value
        return Action(save=step in (save_at, stop_at), stop=step == stop_at)


class AgreedRequests:
    """This process's first stop signal is a stop request; a second one stops at once
    (KeyboardInterrupt), unless within REPEAT_WINDOW_S of the first: the same request twice."""

    def __init__(self, sync: Any, world_size: int, interval_minutes: float):
        self.sync = sync
        self.world_size = world_size
        self.interval = Interval(interval_minutes)
        self.received: int | None = None
        self.received_at = 0.0
        self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}

    def handle(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        note_stop_signal()
        if self.received is None:
            self.received, self.received_at = signum, now
        elif now - self.received_at > REPEAT_WINDOW_S:
            raise KeyboardInterrupt

    def poll(self, rank: int, step: int) -> Action:
        wishes = (self.received is not None, self.interval.due())
        if self.world_size > 1:
            wishes = tuple(map(any, zip(*self.sync.gather(wishes))))
        stop, save = wishes
        return Action(save=save or stop, stop=stop)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

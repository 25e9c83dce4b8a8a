"""Saving and stopping where every worker agrees.

A stop request (a signal: app/runtime/stop_signals.py) or the --checkpoint-interval timer asks
for a checkpoint, which every worker must save at the same place: it gathers state from all of
them. The places are the workers' poll points, the same sequence for every worker: after each
optimizer step ("trained": a checkpoint there holds something new) and after each whole
checkpoint, the resumed one at the start included ("checkpointed": nothing new since). Workers
are never more than one point apart (a step needs every worker's gradients, a checkpoint every
worker's state), so a target one past the furthest worker is the same next point for all.

One rule for a stop, at every moment: where a step was trained since the last checkpoint, save
it, then stop; where none was (starting, resuming, just saved), stop at once, the last
checkpoint standing. Either way the run ends with PREEMPTED_EXIT_CODE.

- SharedRequests (the driver started the workers, as processes or threads): each worker
  publishes the point it passed in shared memory; the driver, under the same lock, names the
  target, or, with nothing new to save, ends the group itself.
- AgreedRequests (one process, or a launcher with no driver above the workers): each process
  notices its own requests, and the workers combine their wishes at every point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from app.runtime.stop_signals import StopSignals

NOT_STARTED = -1


def trained_point(step: int) -> int:
    return 2 * step


def checkpointed_point(step: int) -> int:
    return 2 * step + 1


@dataclass(frozen=True)
class Action:
    save: bool = False
    stop: bool = False  # at a trained point: save first (a stop's checkpoint)
    ended: bool = False  # the driver ended the group: stop without saving (threads go on)


class Requests(Protocol):
    def poll(self, rank: int, step: int) -> Action:
        """After every optimizer step (`step` steps done)."""

    def checkpointed(self, rank: int, step: int) -> Action:
        """After a checkpoint of step `step` is whole (on the primary: written), and once at
        the start, before the first step (the resumed step, or 0)."""

    def stop_pending(self) -> bool:
        """Whether a stop was asked for (an evaluation under way leaves off)."""


class NoRequests:
    def poll(self, rank: int, step: int) -> Action:
        return Action()

    def checkpointed(self, rank: int, step: int) -> Action:
        return Action()

    def stop_pending(self) -> bool:
        return False


class Every:
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
    """Made by the driver before it starts the workers; passed to each of them."""

    def __init__(self, context: Any, world_size: int):
        self.lock = context.Lock()
        self.points = context.RawArray("q", [NOT_STARTED] * world_size)
        self.save_at = context.RawValue("q", NOT_STARTED)
        self.stop_at = context.RawValue("q", NOT_STARTED)
        self.ended = context.RawValue("b", 0)  # a stop found nothing new: no point saves

    # --- driver side ---
    def ask(self, stop: bool) -> int | None:
        """Schedule a save (and a stop): the step whose checkpoint it will be. None: nothing
        to save (for a stop: every worker is still starting, or none trained a step since the
        last whole checkpoint, so the caller ends the group now and that checkpoint stands;
        for a save: also while the previous one is pending)."""
        with self.lock:
            points = list(self.points)
            furthest = max(points)
            target = furthest + 1
            nothing_new = min(points) == NOT_STARTED or (
                furthest % 2 == 1 and points[0] == furthest)  # the primary wrote it last
            if stop:
                if self.stop_at.value == NOT_STARTED:
                    self.stop_at.value = target  # late workers stop at their first point
                self.ended.value = self.ended.value or nothing_new
                return None if self.ended.value else self.stop_at.value // 2
            if nothing_new or self.save_at.value > min(points) or \
                    self.stop_at.value != NOT_STARTED:
                return None
            self.save_at.value = target
            return (target + 1) // 2  # the first trained point at or after the target

    # --- worker side ---
    def poll(self, rank: int, step: int) -> Action:
        return self._passed(rank, trained_point(step))

    def checkpointed(self, rank: int, step: int) -> Action:
        return Action(stop=self._passed(rank, checkpointed_point(step)).stop)

    def stop_pending(self) -> bool:
        return self.stop_at.value != NOT_STARTED

    def _passed(self, rank: int, point: int) -> Action:
        """Acts on a target the first time a point reaches it: the same point on every worker."""
        with self.lock:
            previous, self.points[rank] = self.points[rank], point
            save_at, stop_at = self.save_at.value, self.stop_at.value
            if self.ended.value:
                return Action(stop=True, ended=True)
        return Action(save=save_at != NOT_STARTED and previous < save_at <= point,
                      stop=stop_at != NOT_STARTED and previous < stop_at <= point)


class AgreedRequests:
    """This process's own requests (its StopSignals; the --checkpoint-interval timer), agreed
    with the other workers at every point. From the first point on, a first request waits for
    the point; a second one raises at once. `signals` None: a thread without them."""

    def __init__(self, sync: Any, world_size: int, interval_minutes: float,
                 signals: StopSignals | None):
        self.sync = sync
        self.world_size = world_size
        self.interval = Every(interval_minutes)
        self.signals = signals
        self.started = False

    def poll(self, rank: int, step: int) -> Action:
        stop, save = self._agreed((self.stop_pending(), self.interval.due()))
        return Action(save=save, stop=stop)

    def checkpointed(self, rank: int, step: int) -> Action:
        if not self.started and self.signals is not None:
            self.started = True  # from here a first request waits for the next point
            self.signals.raise_from = 2
        (stop,) = self._agreed((self.stop_pending(),))
        return Action(stop=stop)

    def stop_pending(self) -> bool:
        return self.signals is not None and self.signals.received is not None

    def _agreed(self, wishes: tuple[bool, ...]) -> tuple[bool, ...]:
        if self.world_size > 1:
            wishes = tuple(map(any, zip(*self.sync.gather(wishes))))
        return wishes

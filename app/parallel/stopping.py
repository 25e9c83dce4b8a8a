"""The one stop loop of a driver over its workers, processes (launcher.supervise) and threads
(threads.watch_group) alike, looked at between the supervisor's waits. Its rule, the same at
every moment (app/runtime/interrupts.py):

- a stop request while no step was trained since the last whole checkpoint (the workers still
  starting, resuming, or just saved): end the group now; that checkpoint stands;
- otherwise: the workers save after the next step (or, where they are evaluating or saving,
  the epoch's checkpoint serves) and stop; the group ends by itself;
- a second request, or --stop-timeout without the workers' end: end the group now; the last
  whole checkpoint stands.

Every way ends with PREEMPTED_EXIT_CODE: a stop was asked for, and a resume goes on from the
run's last checkpoint (the driver's message names it, read from the run folder).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from app.runtime.interrupts import Every, SharedRequests
from app.runtime.stop_signals import StopSignals

log = logging.getLogger("imagenet_dp")


@dataclass(frozen=True)
class Stopping:
    """When the driver asks its workers to save (minutes; 0 = never) and how long it waits for
    them to save and end after a stop request (seconds)."""
    checkpoint_interval: float = 0.0
    stop_timeout: float = 0.0


class StopLoop:
    def __init__(self, requests: SharedRequests, stopping: Stopping,
                 signals: StopSignals | None):
        self.requests, self.stopping, self.signals = requests, stopping, signals
        self.interval = Every(stopping.checkpoint_interval)
        self.deadline: float | None = None

    def tick(self) -> str | None:
        """None while the group goes on; else why it must end now, in words for a message."""
        signals = self.signals
        if signals is None or signals.received is None:
            self.save_when_due()
            return None
        if self.deadline is None:
            if self.requests.ask(stop=True) is None:
                return "no step trained since the last checkpoint"
            self.deadline = time.monotonic() + self.stopping.stop_timeout
            # the step it holds is the workers' next point's (the message at the end names it)
            print(f"{signals.name()}: saving a checkpoint of the step under way, then stopping "
                  "(send it again to stop at once)", file=sys.stderr)
        if signals.requests > 1:
            return "asked again"
        if time.monotonic() > self.deadline:
            return f"no new checkpoint within --stop-timeout {self.stopping.stop_timeout:g} s"
        return None

    def save_when_due(self) -> None:
        if self.interval.due():
            step = self.requests.ask(stop=False)
            if step is not None:
                log.info("--checkpoint-interval %g min: saving a checkpoint after step %d",
                         self.stopping.checkpoint_interval, step)

    def ended(self, why: str, what: str) -> str:
        """The message for a group this loop ended (`what`: "all 3 processes")."""
        return f"stopped by {self.signals.name()}: {why}; ended {what}"

"""--max-restarts N on one machine: after a failure (the supervisor has stopped every process),
start the whole group again, up to N times, as torchrun's elastic agent does, from the run's
newest checkpoint (the caller's `prepare` finds it). Only failures are retried: a user error
(exit 2) would fail the same way again, and a stop on request (75) was asked for; a stop request
between two starts ends the run there, its last checkpoint standing.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from multiprocessing import connection
from typing import Callable

from app.parallel.launcher import print_failure
from app.runtime.moments import moment
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE, raising_from, stop_signals

FAILED_EXIT_CODE = 1  # the supervisor's code for a process that died or crashed
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class Restart:
    number: int  # 1 for the first restart
    limit: int  # --max-restarts
    cause: str  # which process failed and how: "worker 1 (cpu) was killed by SIGKILL ..."
    backoff_s: float  # the wait before the group starts again


def backoff_s(number: int) -> float:
    """1, 2, 4, ... seconds: time for a port or a device to be released, short next to the
    minutes of work a restart repeats."""
    return min(2.0 ** (number - 1), MAX_BACKOFF_S)


def run_with_restarts(start: Callable[[Callable[[str], None]], int], max_restarts: int,
                      prepare: Callable[[Restart], str]) -> int:
    """`start(on_failure)` runs the group once and returns its exit code, telling `on_failure`
    a failure's cause. Before each restart, `prepare(restart)` gets the next start ready (the
    newest checkpoint), records the restart and says where the group continues (one line)."""
    causes: list[str] = []

    def on_failure(cause: str) -> None:
        print_failure(cause)
        causes.append(cause)

    code = start(on_failure)
    for number in range(1, max_restarts + 1):
        if code != FAILED_EXIT_CODE:
            return code
        restart = Restart(number, max_restarts, causes[-1], backoff_s(number))
        print(f"restart {number} of {max_restarts} in {restart.backoff_s:g} s, "
              f"{prepare(restart)}", file=sys.stderr)
        stopped = wait_unless_stopped(restart.backoff_s)
        if stopped:
            print(f"stopped by {stopped} before restart {number}", file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        code = start(on_failure)
    if code == FAILED_EXIT_CODE and max_restarts:
        print(f"error: gave up after {max_restarts} restart(s) (--max-restarts "
              f"{max_restarts}): the group failed {max_restarts + 1} times", file=sys.stderr)
    return code


def wait_unless_stopped(seconds: float) -> str:
    """Sleep, unless a stop request comes first (or came meanwhile): then the signal's name."""
    signals = stop_signals()
    with raising_from(0):
        moment("driver:restart-wait")
        if signals is None:
            time.sleep(seconds)
            return ""
        if signals.received is None:
            connection.wait([signals.wakeup], timeout=seconds)
        return signals.name()

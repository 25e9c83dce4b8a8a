"""CPU time of this process and every process below it (loader workers, DALI's readers), from
/proc: how many cores an input pipeline really costs, children that are still running
included (getrusage counts only those that ended)."""

from __future__ import annotations

import os
import time

from app.runtime.liveness import descendants

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads, to the microsecond) and of
    every process below it (to the clock tick: 10 ms)."""
    pid = os.getpid()
    total = 0
    for process in descendants(pid):
        try:
            with open(f"/proc/{process}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (after the name)
        except (OSError, IndexError, ValueError):  # gone meanwhile, or no /proc
            continue
    return time.process_time() + total / TICKS

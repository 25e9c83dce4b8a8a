"""Images/s and the CPU time of this process and every process below it (loader workers, DALI's
readers), from /proc: how many cores an input pipeline really costs, children that are still
running included (getrusage counts only those that ended)."""

from __future__ import annotations

import os
import time
from typing import Callable

from app.runtime.liveness import descendants

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def throughput(step: Callable[[], int], steps: int, device) -> dict:
    """Images/s of `steps` calls of `step` (each returns the images it handled), and the cores
    the process tree used meanwhile; the device's queue is waited for at both ends."""
    import torch  # noqa: PLC0415 (start's bench imports this module for TICKS alone)
    wait = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    wait()
    cpu, started = cpu_seconds(), time.perf_counter()
    images = sum(step() for _ in range(steps))
    wait()
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds,
            "cpu_cores": cpu / seconds, "cpu_ms_per_image": 1000 * cpu / images}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads, to the microsecond) and of
    every process below it (to the clock tick: 10 ms)."""
    return time.process_time() + sum(map(process_cpu_seconds, descendants(os.getpid())))


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (after the name)
    except (OSError, IndexError, ValueError):  # gone meanwhile, or no /proc
        return 0.0

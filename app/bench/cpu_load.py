"""Stand-ins for a training run that takes every core (`bin/bench.py upload-lag`): processes
repeating a fixed unit of work, counted in shared memory, so what another process costs them
reads as their rate falling. Imports numpy, not torch, so that a process starts at once."""

from __future__ import annotations

import multiprocessing

import numpy as np

from app.runtime.stop_signals import ignore_stop_signals
from app.runtime.liveness import die_with_parent
from app.runtime.spawning import main_module_spawn_can_run

# One unit: two elementwise passes over 4 MB of float32 (~1 ms), memory-bound as an optimizer
# step is; numpy's elementwise operations use one thread, so a process is one core's load.
UNIT_FLOATS = 1 << 20
STOP_TIMEOUT_S = 10.0


def work(counts, index: int) -> None:
    """A load process: units forever, counted in counts[index] (one writer per slot)."""
    die_with_parent()
    ignore_stop_signals()  # Ctrl-C reaches the whole group: the bench ends these itself
    values = np.linspace(0.0, 1.0, UNIT_FLOATS, dtype=np.float32)
    scratch = np.empty_like(values)
    while True:
        np.sqrt(values, out=scratch)
        np.add(scratch, 1.0, out=values)  # bounded: tends to the golden ratio
        counts[index] += 1


class Load:
    """`processes` load processes at this process's niceness, from start() to stop()."""

    def __init__(self, processes: int):
        context = multiprocessing.get_context("spawn")
        self.counts = context.RawArray("q", processes)
        self.processes = [context.Process(target=work, args=(self.counts, index),
                                          name=f"upload-lag-load-{index}", daemon=True)
                          for index in range(processes)]

    def start(self) -> "Load":
        with main_module_spawn_can_run():
            for process in self.processes:
                process.start()
        return self

    def started(self) -> bool:
        """Every process has finished a unit: rates from now count work, not imports."""
        self.check()
        return all(self.counts)

    def check(self) -> None:
        for process in self.processes:
            if not process.is_alive():
                raise RuntimeError(f"load process {process.name} ended (exit code "
                                   f"{process.exitcode})")

    def units(self) -> int:
        """Units done so far by all of them."""
        self.check()
        return sum(self.counts)

    def stop(self) -> None:
        """SIGKILL: they hold nothing worth a clean end, and ignore the stop signals."""
        started = [process for process in self.processes if process.pid is not None]
        for process in started:
            process.kill()
        for process in started:
            process.join(STOP_TIMEOUT_S)

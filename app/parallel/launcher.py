"""The process supervisor: starts the worker processes (and their sync mode's helpers) from the
run's forkserver (app/runtime/forkserver.py) and watches them: if any dies, all others are
stopped within seconds and the driver exits non-zero naming the process and how it ended.
SIGINT/SIGTERM/SIGUSR1 are the driver's, whether they reach it alone or every process of the
run (children ignore them); what a stop does is the stop loop's (app/parallel/stopping.py), and
the driver ends its children with SIGKILL, which no scheduler sends as a request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any, Callable

import multiprocessing

from app.config import ParallelConfig
from app.parallel.plans import SYNC_MODES
from app.parallel.watch import POLL_S, SyncFailure
from app.runtime import forkserver
from app.runtime.cli import end_process, kill_daemon_children
from app.runtime.devices import WorkerEnv
from app.runtime.errors import USER_ERROR_EXIT_CODE, UserError, first_line
from app.parallel.stopping import Stopping, StopLoop
from app.runtime.interrupts import SharedRequests
from app.runtime.liveness import descendants, die_with_parent, is_alive
from app.runtime.moments import moment
from app.runtime.spawning import main_module_spawn_can_run
from app.runtime.stop_signals import (PREEMPTED_EXIT_CODE, ignore_in_child, raising_from,
                                     stop_signals)

log = logging.getLogger("imagenet_dp")
STOP_GRACE_S = 3.0  # for a killed child to be reaped


def child_entry(name: str, target: Callable, args: tuple, reports: Queue,
                caller: forkserver.Caller, server: int) -> None:
    """Wraps every child: takes the driver's environment and output as they were at its start,
    dies with the forkserver `server` (which ends with the driver), leaves every stop signal to
    the driver (each reaching every process is one request to save, passed on by the driver) and
    reports why it failed before exiting non-zero."""
    forkserver.take_over(caller)
    die_with_parent(server)
    # Ignored before unblocked: one sent to every process while this child started (blocked
    # since the fork) is dropped here; the driver got it too.
    ignore_in_child()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        code = target(*args) or 0
    except BaseException as error:  # noqa: BLE001 (reported to the driver)
        # Its loader processes go now: once the error is dropped, their graceful stop (a join
        # of up to 5 s each) would keep this failed process, and so the run, alive.
        kill_daemon_children()
        code = report_failure(name, error, reports)
    end_process(code)  # the report is flushed to the driver first; no slow teardown


def report_failure(name: str, error: BaseException, reports: Queue) -> int:
    """The failure as one line for the driver; the exit code."""
    if isinstance(error, UserError):
        reports.put((name, str(error), "user"))
        return USER_ERROR_EXIT_CODE
    if isinstance(error, SyncFailure):  # one line; "sync" if it only noticed another's failure
        reports.put((name, str(error), "sync" if error.noticed_only else "transport"))
        return 1
    traceback.print_exception(error)
    reports.put((name, first_line(error, 300, with_type=True), "crash"))
    return 1


# --- the driver side --------------------------------------------------------------------

@dataclass
class Child:
    name: str
    process: BaseProcess


def print_failure(cause: str) -> None:
    print(f"error: {cause}; stopped the other processes", file=sys.stderr)


def launch(target: Callable, job: Any, devices: list[str], mode: str,
           config: ParallelConfig, stopping: Stopping = Stopping(),
           on_failure: Callable[[str], None] = print_failure, replaceable: bool = False,
           on_tick: Callable[[], None] | None = None, preload: tuple[str, ...] = ()) -> int:
    """Run `target(job, env, plan, cpu_workers)` once per device (`mode`: a SYNC_MODES key): in
    this process for an in-process mode (unless `replaceable`: the caller may have to replace the
    worker), else in processes from the forkserver, which imports the targets' modules and
    `preload` once. Returns 0, PREEMPTED_EXIT_CODE or a failure's code, its cause told to
    `on_failure` in one line. `on_tick` runs every POLL_S."""
    sync_mode = SYNC_MODES[mode]
    if sync_mode.in_process and not replaceable:
        plan = sync_mode.setup(None, devices, config, None).plan
        return target(job, WorkerEnv(rank=0, world_size=1, device=devices[0]), plan, 1) or 0
    # After a failure the queues of killed processes are cleaned up by multiprocessing's
    # resource tracker, which then warns about "leaked semaphores": expected, not a leak here.
    os.environ.setdefault("PYTHONWARNINGS", "ignore:resource_tracker:UserWarning")
    context = multiprocessing.get_context("forkserver")
    reports = context.Queue()
    requests = SharedRequests(context, len(devices))
    setup = sync_mode.setup(context, devices, config, requests)
    cpu_workers = devices.count("cpu")
    runs = [(h.name, h.target, h.args) for h in setup.helpers]
    runs += [(f"worker {rank} ({device})", target,
              (job, WorkerEnv(rank=rank, world_size=len(devices), device=device), setup.plan,
               cpu_workers)) for rank, device in enumerate(devices)]
    with raising_from(0):  # from the first child on, a stop is the stop loop's
        try:
            children = start_children(context, runs, reports, set(preload))
        except forkserver.StartFailure as failure:
            on_failure(str(failure))
            return 1
        log.info("started %s: %s", mode,
                 ", ".join(f"{c.name} pid {c.process.pid}" for c in children))
        moment("driver:started")
        server = forkserver.server_pid()
        return supervise(children, reports, requests, stopping, on_failure, on_tick, server)


def start_children(context: Any, runs: list[tuple[str, Callable, tuple]], reports: Queue,
                   preload: set[str]) -> list[Child]:
    """Each (name, target, args) in a process of its own, forked by the forkserver once it has
    imported the targets' modules and `preload`; StartFailure if the server died meanwhile."""
    preload |= {forkserver.module_of(target) for _, target, _ in runs}
    with raising_from(1):  # no child yet: a stop while the server imports ends the run at once
        forkserver.start(preload)
        moment("driver:launch")
        forkserver.context(preload)
    server, caller = forkserver.server_pid(), forkserver.caller_now()
    children = [Child(name, context.Process(
        target=child_entry, args=(name, target, args, reports, caller, server)))
        for name, target, args in runs]
    with main_module_spawn_can_run(), forkserver.no_silent_restart():
        for child in children:
            try:
                child.process.start()
            except (OSError, EOFError) as error:  # no answer to our request, or a broken pipe
                stop_all([c for c in children if c.process.pid is not None])
                if forkserver.is_running():
                    raise forkserver.StartFailure(f"{child.name} ended before it had read what "
                                                  f"it runs ({first_line(error)})") from None
                raise forkserver.StartFailure(f"the forkserver (pid {server}) that starts this "
                                              f"run's processes died while starting "
                                              f"{child.name}") from None
    return children


def supervise(children: list[Child], reports: Queue, requests: SharedRequests,
              stopping: Stopping, on_failure: Callable[[str], None] = print_failure,
              on_tick: Callable[[], None] | None = None, server: int | None = None) -> int:
    """Wait for all children to finish; on the first failure stop them all; a stop request is
    the stop loop's (app/parallel/stopping.py). `server`: the forkserver (the children die
    with it)."""
    signals = stop_signals()
    loop = StopLoop(requests, stopping, signals)
    with raising_from(0):
        while True:
            running = [c.process.sentinel for c in children if c.process.exitcode is None]
            if running:
                connection.wait([*running, *([signals.wakeup] if signals else [])],
                                timeout=POLL_S)
                if signals:
                    signals.clear_wakeups()
            if on_tick:
                on_tick()
            why = loop.tick()
            if why:
                stop_all(children)
                print(loop.ended(why, f"all {len(children)} processes"), file=sys.stderr)
                return PREEMPTED_EXIT_CODE
            if any(map(has_failed, children)):
                # Looked at again once all are stopped: a big process killed a moment ago may
                # still be tearing down its memory, not yet reapable, while a peer that
                # noticed it is gone has already exited.
                ended = stop_all(children)
                failed = [c for c in children if has_failed(c) and c.name not in ended]
                code, cause = describe_failure(failed, drain(reports), server)
                on_failure(cause)
                # Stopped on request all the same: the run's checkpoint is what a resume takes
                return PREEMPTED_EXIT_CODE if signals and signals.received else code
            if not running:
                codes = {c.process.exitcode for c in children}
                return PREEMPTED_EXIT_CODE if PREEMPTED_EXIT_CODE in codes else 0


def drain(reports: Queue) -> dict[str, tuple[str, str]]:
    found = {}
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            name, message, kind = reports.get(timeout=0.1)
        except Exception:  # noqa: BLE001 (queue.Empty; the queue module is not exported)
            break
        found.setdefault(name, (message, kind))
    return found


def describe_failure(failed: list[Child], reports: dict[str, tuple[str, str]],
                     server: int | None = None) -> tuple[int, str]:
    """(exit code, cause). The cause is the root one: the forkserver's death (every child dies
    with it), then a process that was killed, crashed or hit a user error, before those that
    only noticed a peer was gone."""
    if server is not None and not is_alive(server):
        return 1, (f"the forkserver (pid {server}) that starts this run's processes died, "
                   f"and {len(failed)} process(es) with it")
    child = sorted(failed, key=lambda c: reports.get(c.name, ("", ""))[1] == "sync")[0]
    code = child.process.exitcode
    message, kind = reports.get(child.name, ("", ""))
    if code < 0:
        cause = f"was killed by {signal.Signals(-code).name}"
        if -code == signal.SIGKILL:
            cause += " (by a user or the out-of-memory killer)"
    elif message:
        cause = f"failed: {message}"
    else:
        cause = f"exited with code {code}"
    return (USER_ERROR_EXIT_CODE if kind == "user" else 1), f"{child.name} {cause}"


def has_failed(child: Child) -> bool:
    return child.process.exitcode not in (None, 0, PREEMPTED_EXIT_CODE)


def stop_all(children: list[Child]) -> set[str]:
    """SIGKILL every child, and the grandchildren (loader processes) found before their parents
    went: the stop signals are requests to save, left to the driver, so its order to end must be
    one no scheduler sends as a request. Returns the names of the children this ended (not those
    that were ending anyway)."""
    alive = [c for c in children if c.process.exitcode is None]
    below = [pid for c in alive for pid in descendants(c.process.pid)]
    for child in alive:
        child.process.kill()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in alive:
        child.process.join(timeout=max(0.0, deadline - time.monotonic()))
    for pid in filter(is_alive, below):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {c.name for c in alive if c.process.exitcode in (None, -signal.SIGKILL)}

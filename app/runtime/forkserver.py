"""Where a run's processes start from: one forkserver per driver imports once what the workers
and the parameter server need (torch, the model library, the loop), then forks each in
milliseconds, restarts included. Not a fork of the driver: it may hold what a fork must not copy
(an S3 client's threads, a notebook's CUDA context). Python's forkserver has four traps,
handled here or in app/parallel/launcher.py `child_entry`:

- it imports its preload with the sys.path of its start and silently skips a module it cannot
  import: it gets the caller's sys.path as PYTHONPATH, and a probe checks (`check_preloaded`);
- its children inherit its environment and output, not the caller's current ones: each child
  takes over the caller's as they are when it starts (`caller_now`, `take_over`);
- its children hold its "alive" pipe, keeping it running: the kernel ends it with the driver
  all the same (forkserver_init.py), and each child with it;
- Python silently starts a new one when it finds it dead as a process starts: here that is a
  failure like any process's death (`no_silent_restart`).

Imports nothing of app/ but runtime's own modules, and no torch: the driver stays light.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import sys
from multiprocessing import forkserver
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Callable, Iterable, Iterator

from app.runtime.errors import UserError, first_line
from app.runtime.forkserver_init import PARENT
from app.runtime.stop_signals import blocked
from app.runtime.private_api import PassedFd, forkserver_restart_refused
from app.runtime.private_api import forkserver_pid as server_pid
from app.runtime.spawning import main_module_spawn_can_run

PROBE_TIMEOUT_S = 600.0  # the server's own imports come first: seconds, minutes on a busy box

GUARD = "app.runtime.forkserver_init"  # imported first: the server dies with its parent
_preloaded: frozenset[str] = frozenset()  # what the running server was asked to import
_unchecked = False  # started, and not yet found by a probe to have imported all of it


class StartFailure(RuntimeError):
    """The run's processes could not be started: the forkserver died (killed while it
    imported, say), or a process ended before it had read what it runs."""


@dataclass(frozen=True)
class ByName:
    """A process's entry point by module and function name: whoever starts the process need not
    import the module (the forkserver has), and the module is what the server preloads."""
    module: str
    function: str

    def __call__(self, *args: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.function)(*args)


def module_of(target: Callable) -> str:
    """What the forkserver imports for `target` to run without imports of its own."""
    return target.module if isinstance(target, ByName) else target.__module__


def start(preload: Iterable[str]) -> None:
    """Start the server (unless it runs with at least `preload`), without waiting for its
    imports. One that lacks a module is started again with both sets; one that died after it had
    served is started anew; one that died before a probe found it ready was killed while this run
    started: StartFailure (once)."""
    global _preloaded, _unchecked
    wanted = frozenset(preload)
    pid = server_pid()
    if pid is not None:
        if is_running():
            if wanted <= _preloaded:
                return
            wanted |= _preloaded
            stop()
        elif _unchecked:
            _unchecked = False
            raise StartFailure(f"the forkserver (pid {pid}) that starts this run's processes "
                                "died while it imported")
    _preloaded, _unchecked = wanted, True
    forkserver.set_forkserver_preload([GUARD, *sorted(wanted - {GUARD})])
    # started with the stop signals blocked: one sent to every process of a job leaves the
    # server alone (it ends with the driver), and forkserver_init ignores them
    with importable_as_here(), blocked():
        forkserver.ensure_running()  # reaps a dead server first (is_running leaves it)


def context(preload: Iterable[str]) -> BaseContext:
    """The context to start the run's processes with: a server that has imported `preload`,
    checked (UserError: a module could not be imported there; StartFailure: it died)."""
    global _unchecked
    preload = sorted(set(preload))
    start(preload)
    try:
        check_preloaded(preload)
    except (UserError, StartFailure):
        stop()  # the next start begins afresh, without the module that failed
        raise
    _unchecked = False
    return multiprocessing.get_context("forkserver")


def stop() -> None:
    """End the server now (SIGKILL: one still importing would otherwise finish first)."""
    global _preloaded, _unchecked
    pid = server_pid()
    if pid is not None and is_running():
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # gone; the next start reaps it
    _preloaded, _unchecked = frozenset(), False


def is_running() -> bool:
    """Whether the server started by this process is alive. A dead one is not reaped here:
    Python's ensure_running reaps it, and forgets it, as it starts the next (`start`)."""
    pid = server_pid()
    if pid is None:
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:  # reaped by someone else
        return False


@contextlib.contextmanager
def no_silent_restart() -> Iterator[None]:
    """Around starting processes: a dead server is a StartFailure at once, not a silent
    restart (only `start` starts one)."""
    def ensure_alive() -> None:
        if not is_running():
            raise StartFailure(f"the forkserver (pid {server_pid() or 'gone'}) that starts "
                                "this run's processes died")
    with forkserver_restart_refused(ensure_alive):
        yield


@contextlib.contextmanager
def importable_as_here() -> Iterator[None]:
    """Around the server's start: it imports its preload before it knows our sys.path (Python
    applies sys.path only to each child), so the path goes to it as PYTHONPATH; and it learns
    who started it, to die with that process (app/runtime/forkserver_init.py)."""
    server_only = {"PYTHONPATH": os.pathsep.join(path or os.getcwd() for path in sys.path),
                   PARENT: str(os.getpid())}
    previous = {name: os.environ.get(name) for name in server_only}
    os.environ.update(server_only)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def check_preloaded(modules: list[str]) -> None:
    """A child of the server reports which of `modules` it did not find imported, each
    imported there once more to tell why. The probe starts once the server has imported
    everything (it forks nothing before), or fails at once when the server dies meanwhile."""
    context = multiprocessing.get_context("forkserver")
    reader, writer = context.Pipe(duplex=False)
    probe = context.Process(target=report_missing, args=(modules, writer),
                            name="forkserver probe")
    died = StartFailure(f"the forkserver (pid {server_pid()}) that starts this run's "
                         f"processes died while it imported {', '.join(modules)}")
    try:
        with main_module_spawn_can_run(), no_silent_restart():
            probe.start()
        writer.close()
        if not reader.poll(PROBE_TIMEOUT_S):
            raise StartFailure(f"the forkserver did not answer within {PROBE_TIMEOUT_S:.0f} s")
        missing = reader.recv()
    except (EOFError, OSError, StartFailure):
        if probe.pid is None or not is_running():
            raise died from None
        probe.join(timeout=PROBE_TIMEOUT_S)
        raise StartFailure(f"a process started by the forkserver ended as it started (exit "
                            f"code {probe.exitcode}); its error is above") from None
    finally:
        writer.close()
        reader.close()
        if probe.pid is not None:
            probe.join(timeout=PROBE_TIMEOUT_S)
    if missing:
        name, why = next(iter(missing.items()))
        raise UserError(f"the forkserver that starts this run's processes could not import "
                        f"{name}: {why}; check that `python -c 'import {name}'` works with "
                        "this interpreter and PYTHONPATH")


def report_missing(modules: list[str], writer) -> None:
    """In the probe child: {module: why} for each module the server had not imported."""
    missing = {}
    for name in [m for m in modules if m not in sys.modules]:
        try:
            importlib.import_module(name)
            missing[name] = "it was not importable when the server started (sys.path?)"
        except BaseException as error:  # noqa: BLE001 (the reason, in one line)
            missing[name] = first_line(error, 200, with_type=True)
    writer.send(missing)
    writer.close()


@dataclass(frozen=True)
class Caller:
    """What a child takes over from the process that starts it, not from the server: the
    environment, and where stdout and stderr go (each a descriptor passed to the child)."""
    environ: dict[str, str]
    outputs: tuple[tuple[int, PassedFd | int], ...]


def caller_now() -> Caller:
    """The caller's environment and output as they are now, for a child (`take_over`)."""
    return Caller(dict(os.environ), tuple((fd, PassedFd(fd)) for fd in (1, 2) if is_open(fd)))


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # a daemon's closed stdout: the child keeps the server's
        return False
    return True


def take_over(caller: Caller) -> None:
    """In a child of the server: the environment and output of the caller that started it (a
    restarted worker, a second app.train in a notebook), not the server's."""
    os.environ.clear()
    os.environ.update(caller.environ)
    for fd, received in caller.outputs:
        os.dup2(received, fd)
        os.close(received)

"""Where a run's processes start from: one forkserver per driver, which imports once what the
workers and the parameter server need (torch, the model library, the training loop), then
forks each of them: a process starts in milliseconds instead of paying seconds of imports, and
a restart after a failure starts its group again from the same server.

Why a forkserver and not fork: the driver may hold what a fork must not copy (an S3 client's
threads, a notebook's CUDA context); the forkserver is a fresh interpreter that imports modules
and does nothing else, so it never starts CUDA or a client. Python's forkserver has three traps,
each handled here or where the child starts (app/parallel/launcher.py `child_entry`):

- it imports its preload with the environment and sys.path of the moment it started, and
  silently skips a module it cannot import: it is started with the caller's sys.path on its
  PYTHONPATH, and a probe child checks that every module was imported (`check_preloaded`), so
  a failed preload is an error, not seconds of imports paid by every process;
- its children inherit its environment and its output, not the caller's current ones: each
  child is handed `os.environ` as it is when it is started, and the caller's stdout and stderr
  as they are then (`caller_now`: a notebook's second run, a caller that captures output);
  sys.path and the working folder travel with every child anyway (multiprocessing's
  preparation data);
- its children are its own, not the driver's, and each holds the server's "alive" pipe, which
  keeps the server running while any child runs: the kernel ends it with the driver all the
  same (app/runtime/forkserver_init.py, its first import), and each child with it;
- it is started again, without a word and after seconds of imports, when Python finds it dead
  as a process is to start (even one killed a moment before): here that is a failure like any
  process's death (`no_silent_restart`).

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
from app.runtime.interrupts import STOP_SIGNALS
from app.runtime.private_api import PassedFd, forkserver_restart_refused
from app.runtime.private_api import forkserver_pid as server_pid
from app.runtime.spawning import main_module_spawn_can_run

PROBE_TIMEOUT_S = 600.0  # the server's own imports come first: seconds, minutes on a busy box

GUARD = "app.runtime.forkserver_init"  # imported first: the server dies with its parent
_preloaded: frozenset[str] = frozenset()  # what the running server was asked to import
_unchecked = False  # started, and not yet found by a probe to have imported all of it


class StartFailure(RuntimeError):
    """The run's processes could not be started: the forkserver died (killed while it
    imported, say), or a process ended before it had read what it runs. One line, like a
    process's death."""


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
    """Start the server (unless it runs with at least `preload` already), without waiting for
    its imports: they run while the caller goes on. A server that lacks a module is started
    again with both sets (a notebook that trains another kind of model next). One that died
    after it had served (the run it served has failed, or ended) is started anew; one that
    died before a probe found it ready was killed while this run started: StartFailure (once;
    the next start starts anew)."""
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
    with importable_as_here(), stop_signals_blocked():
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
    """Around starting processes: Python starts a new server, and waits for its imports, when
    it finds the old one dead as it asks for a child; a server that died is a failure here
    instead (only `start` starts one), so the caller learns of it at once."""
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


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Around the server's start: it inherits these signals blocked, so a signal sent to every
    process of a job (Slurm's scancel and preemption, a terminal's Ctrl-C) leaves it alone; it
    ends with the driver instead (its "alive" pipe). Its children unblock them
    (`unblock_stop_signals`). Blocked, not ignored: one that reaches the driver meanwhile is
    delivered once this ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def check_preloaded(modules: list[str]) -> None:
    """A child of the server reports which of `modules` it did not find already imported;
    each such module is imported there once more to tell why it failed. The probe starts once
    the server has imported everything (it forks nothing before), or fails at once when the
    server dies meanwhile: its answer to our request never comes, the pipe ends."""
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
    outputs = tuple((fd, PassedFd(fd)) for fd in (1, 2) if is_open(fd))
    return Caller(dict(os.environ), outputs)


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # a daemon's closed stdout: the child keeps the server's
        return False
    return True


def take_over(caller: Caller) -> None:
    """In a child of the server: the environment and output of the caller that started it,
    not those the server was started with (a restarted worker, a second app.train in a
    notebook, a caller whose output went elsewhere since)."""
    os.environ.clear()
    os.environ.update(caller.environ)
    for fd, received in caller.outputs:
        os.dup2(received, fd)
        os.close(received)

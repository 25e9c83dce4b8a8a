"""What every bin/ entry point shares: user mistakes become one line on stderr and exit 2; the
process ends without the interpreter's slow teardown."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
from typing import Callable, NoReturn

from app.runtime.errors import USER_ERROR_EXIT_CODE, UserError
from app.runtime.private_api import run_exit_handlers
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE, StopRequested

INTERRUPTED_EXIT_CODE = 130


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except StopRequested as stop:  # before the run had anything to save
        print(f"stopped by {stop.name} before training began: nothing to save", file=sys.stderr)
        return PREEMPTED_EXIT_CODE


def kill_daemon_children() -> None:
    """SIGKILL this process's daemon children (loader processes), which die with it anyway."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def end_process(code: int) -> NoReturn:
    """Exit with `code` once the work is done: the exit handlers run (multiprocessing joins
    this process's children, logging flushes), the output is flushed, and the process ends at once,
    skipping the interpreter's slow teardown (seconds, measured, for a killed run) for which a scheduler
    would hold the job's nodes. Daemon children (loader processes) are killed first: multiprocessing
    would SIGTERM them and wait, and they ignore SIGTERM."""
    kill_daemon_children()
    run_exit_handlers()  # what sys.exit would run, in the same order
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a pipe nobody reads any more
            stream.flush()
    os._exit(code)

"""The run folder's uploader in a process of its own, beside the one that trains.

Why a process and not a thread of the training process: an upload is Python work (s3fs's
event loop, reading and hashing parts, retries) that holds the interpreter lock between
the training loop's own Python steps, and its CPU time lands on the cores the loop's threads
expect to have. In its own process it never takes the training process's lock. It runs at
the training's own priority (UPLOAD_NICENESS): `bin/bench.py upload-lag` measured, on 2 cores
kept busy by processes at niceness 0, a 189 MB save reaching the bucket's last.pt a median
10.9x later than on an idle machine at niceness 19 (starved: what a spot machine that dies
then loses), 4.1x at 10 and 2.5x at 0, while the busy processes slowed alike (1.4-1.5x) at
all three. On an idle machine (after the last step, in a preemption's grace period) it has
every core. It imports only the catalog's storage code (fsspec, s3fs), not torch, so it starts
in about a second, spawned: the driver may hold an object-store client's threads or a CUDA
context, which must not cross a fork.

What it does is app/catalog/uploader.py's Uploader; this module only carries its reports to the
driver's log and its outcome back. It dies with the process that started it (a killed driver
leaves no uploader behind; the bucket's last.pt still names a whole checkpoint), and ignores
stop signals: Slurm and a machine's shutdown signal every process, and the uploader's last
pass is what the driver asks for then, within --stop-timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

from app.catalog.remote_run import RemoteRunFolder
from app.catalog.uploader import POLL_S, Mirrored, Uploader
from app.runtime.interrupts import ignore_stop_signals
from app.runtime.liveness import die_with_parent
from app.runtime.spawning import main_module_spawn_can_run

UPLOAD_NICENESS = 0  # the training's own: a lower one starves the upload on busy cores
# After the last pass's own timeout: the process's answer and exit, on a loaded machine.
ANSWER_GRACE_S = 10.0


class UploadProcess:
    """Mirrors `local` to `remote` from a child process until finish()."""

    def __init__(self, local: Path, remote: RemoteRunFolder, keep: int,
                 report: Callable[[str], None], niceness: int = UPLOAD_NICENESS):
        self.local, self.remote, self.report = Path(local), remote, report
        self.busy_s = 0.0  # seconds spent uploading, in all (known after finish)
        self._outcome: tuple[Mirrored, float] | None = None
        self._answered = threading.Event()
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self._process = context.Process(target=serve, name="run-folder-upload", daemon=True,
                                        args=(self.local, remote, keep, niceness, child_end))
        with main_module_spawn_can_run():
            self._process.start()
        child_end.close()
        self._reader = threading.Thread(target=self._read, name="run-folder-upload-reports",
                                        daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """The child's reports into the driver's log, until its outcome (or its death)."""
        try:
            while True:
                kind, payload = self._connection.recv()
                if kind == "report":
                    self.report(payload)
                else:
                    self._outcome = payload
                    return
        except (EOFError, OSError):  # it died: finish() says so
            pass
        finally:
            self._answered.set()

    def finish(self, timeout: float) -> Mirrored:
        """A last pass for what is left, within `timeout` seconds (as Uploader.finish)."""
        try:
            self._connection.send(max(timeout, 0.0))
        except OSError:  # it died already
            pass
        self._answered.wait(max(timeout, POLL_S) + ANSWER_GRACE_S)
        if self._outcome is None:
            self._process.kill()
            self._process.join(ANSWER_GRACE_S)
            why = ("(an upload in progress)" if self._process.exitcode == -9 else
                   f"(the upload process ended with exit code {self._process.exitcode})")
            return Mirrored((why,), "")
        self._process.join(ANSWER_GRACE_S)
        mirrored, self.busy_s = self._outcome
        return mirrored


def serve(local: Path, remote: RemoteRunFolder, keep: int, niceness: int,
          connection: Connection) -> None:
    """The child: mirror until the driver asks for the last pass, then answer with its outcome.
    The driver's death closes the pipe (and the kernel kills this process: die_with_parent)."""
    die_with_parent()
    ignore_stop_signals()
    os.nice(niceness)
    sending = threading.Lock()  # the uploader's thread reports while this one answers

    def send(kind: str, payload: object) -> None:
        with sending:
            connection.send((kind, payload))

    uploader = Uploader(local, remote, keep, report=lambda text: send("report", text)).start()
    try:
        timeout = connection.recv()
    except EOFError:
        return
    mirrored = uploader.finish(timeout)
    send("outcome", (mirrored, uploader.busy_s))

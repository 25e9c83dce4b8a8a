"""The run folder's upload process: what the run saves goes to its bucket as it is saved.

The run tells this process's inbox (`Uploads`) what it wrote: a checkpoint and the names now
pointing at it (last.pt, best.pt), or the record (metrics.jsonl, ...). The newest checkpoint
goes first (at a preemption the stop's matters), then the record, then older ones. step-N.pt
goes up under its own name before the bucket's last.pt and best.pt become copies of it, so a
process killed at any moment leaves last.pt naming a whole checkpoint.

A process, so that uploads never hold the training's interpreter lock, at the training's
priority (UPLOAD_NICENESS says why); spawned, without torch. It dies with the driver and
ignores stop signals (Slurm signals every process): its last uploads are what the driver asks
for within --stop-timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Iterable

from app.catalog.remote_run import RemoteRunFolder, refusal
from app.catalog.retry import DENIED, MISSING, failure, request_errors
from app.runtime.files import stamp
from app.runtime.moments import moment
from app.runtime.stop_signals import blocked, ignore_in_child
from app.runtime.liveness import die_with_parent
from app.runtime.spawning import main_module_spawn_can_run

# The training's own priority. Measured with a 189 MB checkpoint while CPU-bound processes held
# both cores of a 2-core machine: at niceness 19 the bucket's last.pt named a save 10.9x later
# than with the cores idle (the upload starved), at 0 1.3x later, and the upload's own CPU
# slowed the busy work by 1.05x: a lower priority would buy at most those 5%.
UPLOAD_NICENESS = 0
RETRY_WAITS_S = (2.0, 4.0, 8.0, 16.0, 30.0)  # after the clients' own tries (app/catalog/retry.py)
ANSWER_GRACE_S = 2.0  # after the deadline, for the answer's way back on a loaded machine
EARLIER_STEP_FILE = re.compile(r"step-\d+\.pt$")  # an earlier session's, pruned by --keep too
MB = 1e6


@dataclass(frozen=True)
class Saved:  # a checkpoint whole on disk and the names now pointing at it, in the run folder
    step_file: str
    pointers: tuple[str, ...]


@dataclass(frozen=True)
class Record:  # the run's files beside its checkpoints, as they are now
    files: tuple[str, ...]


@dataclass(frozen=True)
class Finish:  # upload what is left until `deadline` (time.monotonic() of this machine)
    deadline: float


@dataclass(frozen=True)
class Mirrored:
    """Where the uploads stand: `waiting` names what the bucket lacks (empty: it holds all)."""
    waiting: tuple[str, ...]
    newest: str = ""  # the newest checkpoint saved ("" if none)
    newest_named: bool = False  # the bucket's last.pt (and best.pt, if it moved) is a copy of it


class Uploads:
    """The saving side's end of the inbox (a pipe, carried by the job): a message is one small
    write, read at once whatever is uploading, so no step waits for an upload."""

    def __init__(self, local: Path, connection: Connection):
        self.local, self.connection = Path(local), connection

    def saved(self, step_file: Path, pointers: Iterable[Path]) -> None:
        self.send(Saved(self._relative(step_file), tuple(map(self._relative, pointers))))

    def record(self) -> None:
        """The run folder's files outside checkpoints/ (hidden ones: writes in progress)."""
        files = []
        for folder, subfolders, names in os.walk(self.local):
            subfolders[:] = [name for name in subfolders if name != "checkpoints"]
            files += [self._relative(Path(folder, n)) for n in names if not n.startswith(".")]
        self.send(Record(tuple(sorted(files))))

    def send(self, message: Saved | Record | Finish) -> None:
        # it died: the driver's finish says so
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.connection.send(message)

    def _relative(self, path: Path) -> str:
        return Path(path).relative_to(self.local).as_posix()


class UploadProcess:
    """The upload process as the driver sees it; `uploads` goes to the process that saves."""

    def __init__(self, local: Path, remote: RemoteRunFolder, keep: int,
                 report: Callable[[str], None]):
        self.local, self.remote, self.report = Path(local), remote, report
        self.busy_s = 0.0  # seconds spent uploading, in all (known after finish)
        self._state, self._final = (Mirrored(()), 0.0), False  # as of its last request
        self._answered = threading.Event()
        context = multiprocessing.get_context("spawn")
        inbox, orders = context.Pipe(duplex=False)
        self._answers, answers = context.Pipe(duplex=False)
        self._process = context.Process(target=serve, name="run-folder-upload", daemon=True,
                                        args=(self.local, remote, keep, inbox, answers))
        with main_module_spawn_can_run(), blocked():  # no moment of its start takes a signal
            self._process.start()
        inbox.close()  # the child's alone: a send after its death fails instead of blocking
        answers.close()
        threading.Thread(target=self._read, name="run-folder-upload-reports", daemon=True).start()
        self.uploads = Uploads(self.local, orders)
        self.uploads.record()  # config.toml and skipped.tsv's header, before the first epoch

    def _read(self) -> None:
        """The child's reports into the driver's log, and where it stands, to its outcome."""
        try:
            while not self._final:
                kind, payload = self._answers.recv()
                if kind == "report":
                    self.report(payload)
                else:
                    self._state, self._final = payload, kind == "outcome"
        except (EOFError, OSError):  # it died: finish() says so
            pass
        finally:
            self._answered.set()

    def finish(self, timeout: float) -> Mirrored:
        """The record as the run left it, and what is left, uploaded within `timeout` seconds
        (a request running then is abandoned: an unfinished upload never becomes an object)."""
        timeout = max(timeout, 0.0)
        self.uploads.record()
        self.uploads.send(Finish(time.monotonic() + timeout))
        self._answered.wait(timeout + ANSWER_GRACE_S)
        if not self._final:  # a request still running is abandoned, where it stood said
            self._process.kill()
        self._process.join(ANSWER_GRACE_S)
        mirrored, self.busy_s = self._state
        if self._final:
            return mirrored
        why = ("(an upload in progress)" if self._process.exitcode == -9 else
               f"(the upload process ended with exit code {self._process.exitcode})")
        return dataclasses.replace(mirrored, waiting=(why, *mirrored.waiting))


def serve(local: Path, remote: RemoteRunFolder, keep: int, inbox: Connection,
          answers: Connection) -> None:
    """The child: upload as told, saying where it stands after each request, to Finish."""
    die_with_parent()
    ignore_in_child()
    os.nice(UPLOAD_NICENESS)
    messages: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=receive, args=(inbox, messages), name="inbox", daemon=True).start()
    uploader = Uploader(local, remote, keep, report=lambda text: answers.send(("report", text)))
    mirrored = uploader.start().run(messages, lambda now: answers.send(
        ("progress", (now, uploader.busy_s))))
    if mirrored is not None:
        answers.send(("outcome", (mirrored, uploader.busy_s)))


def receive(inbox: Connection, messages: queue.SimpleQueue) -> None:
    """Moves each message from the pipe to the uploader's queue as it comes: a sender never
    finds the pipe full while an upload runs. None: every sender went without a Finish."""
    try:
        while True:
            messages.put(inbox.recv())
    except EOFError:
        messages.put(None)


class Uploader:
    """What the bucket lacks of the run folder, and the request that brings the next of it."""

    def __init__(self, local: Path, remote: RemoteRunFolder, keep: int,
                 report: Callable[[str], None]):
        self.local, self.remote, self.keep, self.report = Path(local), remote, max(1, keep), report
        self.saves: list[Saved] = []  # this session's, oldest first
        self.steps: set[str] = set()  # step files to upload (the newest --keep saves' only)
        self.whole: set[str] = set()  # step files uploaded whole
        self.in_bucket: set[str] = set()  # step files the bucket holds
        self.named: dict[str, str] = {}  # pointer -> the step file the bucket's copy is of
        self.record: set[str] = set()  # record files whose current bytes the bucket lacks
        self.uploaded: dict[str, tuple[int, int]] = {}  # record file -> (size, mtime_ns) up
        self.failures: dict[str, int] = {}  # failed attempts since the last success
        self.retry_at: dict[str, float] = {}
        self.deadline: float | None = None  # set by Finish
        self.busy_s = 0.0  # seconds spent in uploads

    def start(self) -> "Uploader":
        """What the bucket holds: earlier sessions' step files, record files at their local size."""
        try:
            listed = self.remote.sizes()
        except request_errors():  # the first upload says what fails
            listed = {}
        for relative, size in listed.items():
            if EARLIER_STEP_FILE.search(relative):
                self.in_bucket.add(relative)
            elif (found := stamp(self.local / relative)) and found[0] == size:
                self.uploaded[relative] = found
        return self

    def run(self, messages: queue.SimpleQueue,
            progress: Callable[[Mirrored], None] = lambda _: None) -> Mirrored | None:
        """Takes the messages as they come and makes one request at a time (a newer checkpoint
        said meanwhile goes next) until Finish; None if every sender went without one."""
        while True:
            with contextlib.suppress(queue.Empty):
                message = messages.get(timeout=self.wait_s())
                while message is not None:  # all said so far, before choosing what goes next
                    self.take(message)
                    message = messages.get_nowait()
                return None
            now, work = time.monotonic(), self.work()
            if self.deadline is not None and all(  # nothing left to try before the deadline
                    max(self.retry_at.get(i, 0), now) >= self.deadline for i in work):
                return self.outcome()
            due = [item for item in work if self.retry_at.get(item, 0) <= now]
            if due:
                self.bring(due[0])
                progress(self.outcome())

    def take(self, message: Saved | Record | Finish) -> None:
        if isinstance(message, Saved):
            self.saves.append(message)
            self.whole.discard(message.step_file)  # a resumed run may write a name again
            # Older than the newest --keep: the bucket would drop it at once, the folder has.
            self.steps = ({message.step_file} | self.steps) & {
                save.step_file for save in self.saves[-self.keep:]}
        elif isinstance(message, Record):
            self.record |= {relative for relative in message.files
                            if self.uploaded.get(relative) != stamp(self.local / relative)}
        else:
            self.deadline = message.deadline
            self.retry_at.clear()  # every failed request is tried again at once

    def work(self) -> list[str]:
        """What the bucket lacks, in the order it goes: the newest checkpoint, the pointers
        that can move to a whole one, the record, older checkpoints (newest first)."""
        steps = list(dict.fromkeys(s.step_file for s in reversed(self.saves)
                                   if s.step_file in self.steps))
        newest = steps[:1] if steps and steps[0] == self.saves[-1].step_file else []
        moves = [pointer for pointer, target in self.targets().items()
                 if self.named.get(pointer) != target]
        return newest + moves + sorted(self.record) + steps[len(newest):]

    def targets(self) -> dict[str, str]:
        """Each pointer -> the newest save it was said of whose upload is whole."""
        return {pointer: save.step_file for save in self.saves if save.step_file in self.whole
                for pointer in save.pointers}

    def wait_s(self) -> float | None:
        """For a message, or to the next try of a failed request before Finish's deadline."""
        tries = [self.retry_at.get(item, 0.0) for item in self.work()]
        if self.deadline is not None:
            tries = [at for at in tries if at < self.deadline] or [0.0]
        return max(min(tries) - time.monotonic(), 0.0) if tries else None

    def outcome(self) -> Mirrored:
        newest = self.saves[-1] if self.saves else Saved("", ())
        named = all(self.named.get(p) == newest.step_file for p in newest.pointers)
        return Mirrored(tuple(self.work()), newest.step_file, bool(newest.step_file) and named)

    def bring(self, item: str) -> None:
        """One request for `item`: a pointer's copy, or a file's upload."""
        target = self.targets().get(item)
        try:
            if target is not None:
                self.remote.copy(target, item)
                self.named[item] = target
                self.prune()
            else:
                self.put(item)
        except request_errors() as error:
            if target is None and not (self.local / item).exists():  # rotated away: --keep
                self.steps.discard(item)
                self.record.discard(item)
            else:
                self.failed(item, error)
            return
        if self.failures.pop(item, 0):
            self.report(f"{self.remote.describe(item)} is in the bucket after all: uploads "
                        "work again")
        self.retry_at.pop(item, None)

    def put(self, relative: str) -> None:
        stat = (self.local / relative).stat()
        started = time.monotonic()
        moment(f"upload:{Path(relative).name}")
        self.remote.put(self.local / relative, relative)
        seconds = time.monotonic() - started
        self.busy_s += seconds
        if relative in self.record:
            self.record.discard(relative)
            self.uploaded[relative] = (stat.st_size, stat.st_mtime_ns)
            return
        self.steps.discard(relative)
        self.whole.add(relative)
        self.in_bucket.add(relative)
        backlog = [(stamp(self.local / r) or (0,))[0] for r in (*self.steps, *self.record)]
        size, rate = stat.st_size / MB, stat.st_size / MB / max(seconds, 1e-6)
        self.report(f"uploaded {relative} ({size:.1f} MB) to {self.remote.describe()} in "
                    f"{seconds:.1f} s ({rate:.0f} MB/s); backlog: {len(backlog)} files, "
                    f"{sum(backlog) / MB:.1f} MB")

    def prune(self) -> None:
        """The bucket keeps the newest --keep step files (pointers are copies), and one a pointer
        has yet to copy. A failed delete costs room only: said once, tried after each save."""
        session = {save.step_file: index for index, save in enumerate(self.saves)}
        oldest_first = sorted(self.in_bucket, key=lambda s: (s in session, session.get(s, 0), s))
        moving = {t for pointer, t in self.targets().items() if self.named.get(pointer) != t}
        for old in oldest_first[:-self.keep]:
            try:
                if old not in moving:
                    self.remote.delete(old)
                    self.in_bucket.discard(old)
                    self.failures.pop("delete", None)
            except request_errors() as error:
                if not self.failures.get("delete"):
                    self.report(f"could not delete {self.remote.describe(old)} ({refusal(error)})"
                                "; the bucket keeps it until a delete works again (tried after "
                                "each save)")
                self.failures["delete"] = 1

    def failed(self, item: str, error: BaseException) -> None:
        """Said once per file; tried again after RETRY_WAITS_S (after Finish: not if refused)."""
        count = self.failures.get(item, 0)
        self.failures[item] = count + 1
        # refused (403, no such bucket): no try changes that, and after Finish none waits it out
        refused = self.deadline is not None and failure(error).kind in (MISSING, DENIED)
        self.retry_at[item] = float("inf") if refused else \
            time.monotonic() + RETRY_WAITS_S[min(count, len(RETRY_WAITS_S) - 1)]
        kept = "; the bucket's last.pt still names the checkpoint it named before"
        if not count:
            self.report(f"could not upload {item} to {self.remote.describe()} "
                        f"({refusal(error)}); it stays in {self.local / item}; training goes "
                        "on and the upload is tried again"
                        + (kept if any(s.step_file == item for s in self.saves) else ""))

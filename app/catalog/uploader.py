"""Mirrors a staged run folder to its bucket from a background thread (of the upload process,
app/launch/upload_process.py), so no training step ever waits for the network.

The run writes its folder locally as always (app/catalog/remote_run.py says where); every
POLL_S this thread uploads what changed: the newest checkpoint first (at a preemption the
stop's checkpoint is the one that matters), then config.toml, metrics.jsonl, curves.png,
skipped.tsv and the rest, then older checkpoints. A checkpoint counts as saved in the bucket only once its upload is
whole: step-N.pt is uploaded under its final name (an object store shows an object, multipart
ones included, only when all its bytes are there), and only then does the bucket's last.pt
become a copy of it (a copy inside the bucket) and do the bucket's checkpoints beyond --keep
go. A process killed at any moment leaves the bucket's last.pt naming a whole checkpoint.

A failed upload is said once per file, stays in the staging folder and is tried again on later
passes with growing waits; one that then succeeds is said too.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from app.catalog.remote_run import RemoteRunFolder, refusal
from app.runtime.files import TEMPORARY_SUFFIX

POLL_S = 1.0
RETRY_WAITS_S = (2.0, 4.0, 8.0, 16.0, 30.0)  # before a failed file is tried again
STEP_FILE = re.compile(r"step-\d+\.pt$")
POINTERS = ("last.pt", "best.pt")  # other names of a step file: copied in the bucket
MB = 1e6


@dataclass(frozen=True)
class Mirrored:
    """How the mirror ended: `waiting` names what the bucket lacks (empty: it holds all)."""
    waiting: tuple[str, ...]
    last: str  # the step file the bucket's last.pt is a copy of ("" if none yet)

    @property
    def complete(self) -> bool:
        return not self.waiting


class Uploader:
    def __init__(self, local: Path, remote: RemoteRunFolder, keep: int,
                 report: Callable[[str], None]):
        self.local, self.remote, self.keep, self.report = Path(local), remote, keep, report
        self.uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns)
        self.failures: dict[str, int] = {}  # relative path -> failed attempts since success
        self.retry_at: dict[str, float] = {}
        self.pointers: dict[str, str] = {}  # "last.pt" -> the step file the bucket's copies
        self.newest_uploaded = (0, "")  # (local mtime, name) of the newest whole step file
        self.remote_steps: list[str] = []  # the bucket's step files, oldest first
        self.deadline: float | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="run-folder-upload", daemon=True)
        self.busy_s = 0.0  # seconds spent uploading, in all

    def start(self) -> "Uploader":
        """Start mirroring; files the bucket already holds at their size (this machine's
        staging folder of an earlier attempt) are not uploaded again."""
        try:
            listed = self.remote.sizes()
        except Exception:  # noqa: BLE001 (the first pass says what fails)
            listed = {}
        self.remote_steps = sorted(f.split("/", 1)[1] for f in listed
                                   if f.startswith("checkpoints/") and STEP_FILE.search(f))
        for relative, size in listed.items():
            path = self.local / relative
            if path.name not in POINTERS and path.is_file() and path.stat().st_size == size:
                self.uploaded[relative] = (size, path.stat().st_mtime_ns)
        self.thread.start()
        return self

    def finish(self, timeout: float) -> Mirrored:
        """A last pass for what is left, within `timeout` seconds; an upload still running
        then is abandoned (an unfinished multipart upload never becomes an object)."""
        self.deadline = time.monotonic() + max(timeout, 0.0)
        self.stopping.set()
        # At least a second: a pass with nothing left to upload needs a moment to say so.
        self.thread.join(timeout=max(timeout, POLL_S))
        waiting = self.waiting() if not self.thread.is_alive() else ("(an upload in progress)",)
        return Mirrored(tuple(waiting), self.pointers.get("last.pt", ""))

    # --- the thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stopping.is_set():
            self._safe_pass(final=False)
            self.stopping.wait(POLL_S)
        self._safe_pass(final=True)

    def _safe_pass(self, final: bool) -> None:
        try:
            self._pass(final)
        except Exception as error:  # noqa: BLE001 (the thread must outlive any one failure)
            self.report(f"upload to {self.remote.describe()}: {refusal(error)}")

    def _pass(self, final: bool) -> None:
        for relative in self._changed():
            if self.deadline is not None and time.monotonic() > self.deadline:
                return
            if final or time.monotonic() >= self.retry_at.get(relative, 0.0):
                self._upload(relative)
        self._point_last()
        self._point_best()

    def _changed(self) -> list[str]:
        """Files whose current bytes the bucket lacks: the newest checkpoint, then the small
        files (the record a resumed run goes on with), then older checkpoints, newest first;
        hidden files (temporaries of atomic writes) and the pointers left out. At a stop the
        newest checkpoint and the record are what counts; an older one may miss the bound."""
        found = []
        for path in self.local.rglob("*"):
            relative = path.relative_to(self.local).as_posix()
            if path.name.startswith(".") or path.name.endswith(TEMPORARY_SUFFIX) \
                    or path.name in POINTERS or not path.is_file():
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:  # rotated away by --keep just now
                continue
            if self.uploaded.get(relative) != (stat.st_size, stat.st_mtime_ns):
                found.append((2 if STEP_FILE.search(relative) else 1, -stat.st_mtime_ns,
                              relative))
        found.sort()
        if found and found[-1][0] == 2:  # the newest checkpoint goes first
            newest = min(entry for entry in found if entry[0] == 2)
            found.remove(newest)
            found.insert(0, newest)
        return [relative for *_, relative in found]

    def _upload(self, relative: str) -> None:
        path = self.local / relative
        try:
            stat = path.stat()
        except FileNotFoundError:
            return
        started = time.monotonic()
        try:
            self.remote.put(path, relative, self.deadline)
        except Exception as error:  # noqa: BLE001
            if path.exists():  # else rotated away by --keep mid-upload: nothing to retry
                self._failed(relative, error)
            return
        seconds = time.monotonic() - started
        self.busy_s += seconds
        self.uploaded[relative] = (stat.st_size, stat.st_mtime_ns)
        if self.failures.pop(relative, 0):
            self.report(f"uploaded {self.remote.describe(relative)} after all: uploads work "
                        "again")
        self.retry_at.pop(relative, None)
        if STEP_FILE.search(relative):
            self.remote_steps = [s for s in self.remote_steps if s != path.name] + [path.name]
            self._report_checkpoint(relative, stat.st_size, seconds)
            # the newest save that is whole (by time; saves within one clock tick by name)
            if (stat.st_mtime_ns, path.name) > self.newest_uploaded:
                self.newest_uploaded = (stat.st_mtime_ns, path.name)
                self._point_last()

    def _failed(self, relative: str, error: BaseException) -> None:
        count = self.failures.get(relative, 0)
        self.failures[relative] = count + 1
        self.retry_at[relative] = time.monotonic() + RETRY_WAITS_S[min(count,
                                                                        len(RETRY_WAITS_S) - 1)]
        if count == 0:  # said once per file, not per attempt
            kept = "the bucket's last.pt still names " + (self.pointers.get("last.pt") or
                                                         "the checkpoint it named before")
            self.report(f"could not upload {relative} to {self.remote.describe()} "
                        f"({refusal(error)}); it stays in {self.local / relative}; "
                        f"training goes on and the upload is tried again"
                        + (f"; {kept}" if STEP_FILE.search(relative) else ""))

    def _report_checkpoint(self, relative: str, size: int, seconds: float) -> None:
        backlog = [r for r in self._changed() if r != relative]
        waiting_mb = sum((self.local / r).stat().st_size for r in backlog
                         if (self.local / r).exists()) / MB
        self.report(f"uploaded {relative} ({size / MB:.1f} MB) to {self.remote.describe()} in "
                    f"{seconds:.1f} s ({size / MB / max(seconds, 1e-6):.0f} MB/s); backlog: "
                    f"{len(backlog)} files, {waiting_mb:.1f} MB")

    def _point(self, pointer: str, step_file: str) -> None:
        """The bucket's last.pt (best.pt) becomes a copy of a step file whose upload completed;
        then the bucket keeps only the newest --keep step files (last.pt and best.pt are
        copies, not links: the step files they copied may go)."""
        self.remote.copy(f"checkpoints/{step_file}", f"checkpoints/{pointer}", self.deadline)
        self.pointers[pointer] = step_file
        try:
            while len(self.remote_steps) > self.keep:
                self.remote.delete(f"checkpoints/{self.remote_steps[0]}")
                self.remote_steps.pop(0)
        except Exception:  # noqa: BLE001 (tried again at the next save: costs only room)
            pass

    def _point_last(self) -> None:
        """last.pt names the newest step file whose upload completed (kept trying)."""
        name = self.newest_uploaded[1]
        if not name or self.pointers.get("last.pt") == name:
            return
        try:
            self._point("last.pt", name)
        except Exception as error:  # noqa: BLE001
            self._failed("checkpoints/last.pt", error)
            return
        if self.failures.pop("checkpoints/last.pt", 0):
            self.report(f"{self.remote.describe('checkpoints/last.pt')} names {name} after "
                        "all: uploads work again")

    def _point_best(self) -> None:
        """best.pt follows the local one once the step file it names is in the bucket."""
        target = self._target_of("best.pt")
        if target and f"checkpoints/{target}" in self.uploaded \
                and self.pointers.get("best.pt") != target:
            try:
                self._point("best.pt", target)
            except Exception as error:  # noqa: BLE001
                self._failed("checkpoints/best.pt", error)

    def _target_of(self, pointer: str) -> str:
        target = step_file_of(self.local / "checkpoints" / pointer)
        return target.name if target else ""

    def waiting(self) -> list[str]:
        """What the bucket lacks (a pointer follows its step file at once, see _upload)."""
        waiting = self._changed()
        if self.pointers.get("last.pt", "") != self.newest_uploaded[1]:
            waiting.append("checkpoints/last.pt")
        return waiting


def step_file_of(pointer: Path) -> Path | None:
    """The step file that a checkpoint folder's last.pt or best.pt is another name of (a hard
    link: CheckpointFolder.save); None if the pointer or its step file is gone."""
    try:
        inode = pointer.stat().st_ino
        return next((p for p in pointer.parent.glob("step-*.pt") if p.stat().st_ino == inode),
                    None)
    except FileNotFoundError:
        return None

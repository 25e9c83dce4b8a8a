"""Liveness: no blocking wait without a timeout and a check that the other side still lives;
a peer's failure becomes a one-line SyncFailure."""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from app.runtime.errors import first_line
from app.runtime.liveness import is_alive

POLL_S = 0.5  # how often a blocked wait looks at its peers
ULIMIT_HINT = "raise the open-file limit: ulimit -n"


class SyncFailure(RuntimeError):
    """A peer died, stopped answering, or replicas diverged; the message is one line."""
    noticed_only = True  # this process saw another one fail; the cause is elsewhere


class TransportFailure(SyncFailure):
    """A message could not be sent or rebuilt here: the cause is in this process."""
    noticed_only = False


def likely_cause(error: BaseException) -> str:
    """What went wrong while passing a message, and what to do about it, in one line."""
    detail = first_line(error, 200, with_type=True)
    if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE):
        return f"{detail} ({ULIMIT_HINT})"
    if isinstance(error, EOFError):
        # A shared tensor's descriptor comes over a socket from the sender's resource sharer,
        # which closes it empty-handed when it has run out of descriptors (or exited).
        return (f"{detail}: the sender could not pass a shared-memory handle (it ran out of "
                f"file descriptors or exited; {ULIMIT_HINT})")
    if isinstance(error, (ConnectionError, FileNotFoundError)):
        return f"{detail}: the sender is gone"
    return detail


@contextlib.contextmanager
def peer_loss_as_sync_failure() -> Iterator[None]:
    """torch.distributed reports a lost peer as an exception from wherever the process waited
    (DDP's backward, a gather, init_process_group): gloo's transport as a RuntimeError
    ("Connection reset by peer", "Timed out waiting ..."), NCCL and the stores as a DistError.
    Turned into one line here; any other exception keeps its traceback. Also a decorator."""
    try:
        yield
    except SyncFailure:
        raise
    except RuntimeError as error:
        if not lost_a_peer(error):
            raise
        # The transport's source location says nothing to a user; its advice neither.
        detail = re.sub(r"\[[^\]]*:\d+\]\s*", "", first_line(error, 300))
        detail = detail.split(". This is typically")[0]
        raise SyncFailure(f"lost a peer: {detail} (another process died or stopped "
                          "answering)") from None


def lost_a_peer(error: RuntimeError) -> bool:
    import torch.distributed as dist  # noqa: PLC0415 (the driver never needs it)
    return isinstance(error, dist.DistError) or "gloo/transport" in str(error)


class Abort:
    """Replicas that are threads cannot be killed: when one fails, or a stop cannot wait, the
    others are told through this, and every wait of theirs ends within POLL_S with the reason."""

    def __init__(self):
        self.event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


@dataclass
class Watch:
    """Receives from a queue, checking every POLL_S that the driver and the peers live (and,
    for threads, that nobody asked them to abort)."""
    peers: dict[str, int] = field(default_factory=dict)  # name -> pid
    parent: int = field(default_factory=os.getppid)
    timeout_s: float = 1800.0
    abort: Abort | None = None

    def receive(self, source: "queue.Queue", waiting_for: str):
        started = time.monotonic()
        while True:
            with contextlib.suppress(queue.Empty):
                return self._get(source, waiting_for, POLL_S)
            try:
                self.check()
            except SyncFailure as failure:
                # A peer may have sent its last message and exited since the get timed out.
                try:
                    return self._get(source, waiting_for, None)
                except queue.Empty:
                    raise failure from None
            if time.monotonic() - started > self.timeout_s:
                raise SyncFailure(f"no {waiting_for} for {self.timeout_s:.0f} s although every "
                                  "process is alive (raise --sync-timeout if this is expected)")

    @staticmethod
    def _get(source: "queue.Queue", waiting_for: str, timeout: float | None):
        """One message (None: only if one is there now); a message that arrived but cannot
        be rebuilt here (its shared memory, its pickle) is a TransportFailure."""
        try:
            return source.get(timeout=timeout) if timeout else source.get_nowait()
        except queue.Empty:
            raise
        except Exception as error:  # noqa: BLE001 (any failure to rebuild, in one line)
            raise TransportFailure(f"could not receive the {waiting_for}: "
                                   f"{likely_cause(error)}") from None

    def check(self) -> None:
        if self.abort is not None and self.abort.is_set():
            raise SyncFailure(self.abort.reason)
        if os.getppid() != self.parent:
            raise SyncFailure("the driver process is gone")
        for name, pid in self.peers.items():
            if not is_alive(pid):
                raise SyncFailure(f"{name} (pid {pid}) is gone")

"""Messages between processes: sent and received so that a failure is one line that names the
peer and the likely cause, never a traceback from a queue's thread or a silently lost message.

A multiprocessing queue pickles in a background thread: a message that cannot be pickled (or
whose shared memory cannot be passed, for lack of file descriptors) is reported there as a
traceback and then dropped, and the receiver waits in vain. `post` pickles in the sender's own
thread instead, so the failure is an exception where it happened; the queue then carries the
bytes, and the receiver's `get` rebuilds the message as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.reduction import ForkingPickler

from app.parallel.watch import TransportFailure, likely_cause


class Pickled:
    """A message pickled by its sender; unpickling this rebuilds the message itself."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def __reduce__(self):
        return ForkingPickler.loads, (self.payload,)


def post(queue: Queue, message: tuple, to: str) -> None:
    """Put `message` on `queue` for `to` (a peer's name, for the error message)."""
    if not isinstance(queue, Queue):  # between threads (tests): nothing is pickled
        queue.put(message)
        return
    try:
        payload = bytes(ForkingPickler.dumps(message))
    except Exception as error:  # noqa: BLE001 (whatever pickling raised, said in one line)
        raise TransportFailure(f"could not send {message[0]!r} to {to}: "
                               f"{likely_cause(error)}") from None
    queue.put(Pickled(payload))


@dataclass(frozen=True)
class ServerLinks:
    """The queues between the parameter server and its workers; made by the launcher,
    inherited by both."""
    inbox: Queue  # workers -> server: ("register" | "grads" | "reduce" | "checksum" | "done", ...)
    outboxes: list[Queue]  # server -> worker r: ("hello" | "avg" | "reduced", ...)

    def send_to(self, rank: int, message: tuple) -> None:
        post(self.outboxes[rank], message, f"worker {rank}")

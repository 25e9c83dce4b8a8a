"""Messages between processes, sent so that a failure is one line naming the peer and the likely
cause: a multiprocessing queue pickles in a background thread, where a message that cannot be
pickled (or whose shared memory cannot be passed) is reported as a traceback and dropped while
the receiver waits in vain; `post` pickles in the sender's thread, raising where it happened.
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
    """The queues between the parameter server and its workers, made by the launcher."""
    inbox: Queue  # workers -> server: ("register" | "grads" | "reduce" | "checksum" | "done", ...)
    outboxes: list[Queue]  # server -> worker r: ("hello" | "avg" | "reduced", ...)

    def send_to(self, rank: int, message: tuple) -> None:
        post(self.outboxes[rank], message, f"worker {rank}")

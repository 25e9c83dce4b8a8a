"""Who may touch a bucket when, without a full device synchronize per bucket on either side.

Each worker owns two buffers per bucket: `grads` (it packs, the server reads) and `inbox` (the
server writes the average, the worker unpacks). On CUDA each bucket has two interprocess events,
made by the worker on its device and handed to the server once, with the buffers: `written`,
recorded by the worker after packing and before its message "bucket b of step k is ready",
which the server's stream waits on before any read; and `averaged`, recorded by the server
after enqueuing the copy into the inbox and before its message "average b of step k", which the
worker's stream waits on before the unpack. A message always follows the record it announces,
so a wait never sees an older record than the one meant; and the server never overwrites an
inbox the worker still reads, since the worker packs step k+1 (recording `written` again) only
after its unpack of step k on the same stream. On CPU a process's work is finished when it
sends its message.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class WorkerSignals(Protocol):
    def wrote_gradients(self, bucket: int) -> None: ...
    def wait_for_average(self, bucket: int) -> None: ...
    def for_server(self) -> Any:
        """What the server needs to build its ServerSignals (sent with the registration)."""


class ServerSignals(Protocol):
    def wait_for_gradients(self, worker: int, bucket: int) -> None: ...
    def wrote_average(self, worker: int, bucket: int) -> None: ...


class HostSignals:
    """CPU buffers: every write is complete when the writer sends its message."""

    def wrote_gradients(self, bucket: int) -> None:
        pass

    def wait_for_average(self, bucket: int) -> None:
        pass

    def for_server(self) -> None:
        return None

    def wait_for_gradients(self, worker: int, bucket: int) -> None:
        pass

    def wrote_average(self, worker: int, bucket: int) -> None:
        pass


class CudaWorkerSignals:
    def __init__(self, device: torch.device, buckets: int):
        self.device = device
        self.written = [self._created_event() for _ in range(buckets)]
        self.averaged = [self._created_event() for _ in range(buckets)]

    def _created_event(self) -> torch.cuda.Event:
        """CUDA creates an event lazily, on the device current in the thread that first needs
        it; the registration is pickled in a queue's feeder thread, whose current device is
        GPU 0. Recording it once here creates it on this worker's device."""
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wrote_gradients(self, bucket: int) -> None:
        self.written[bucket].record(torch.cuda.current_stream(self.device))

    def wait_for_average(self, bucket: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.averaged[bucket])

    def for_server(self) -> tuple[list, list]:
        return self.written, self.averaged


class CudaServerSignals:
    """The server's side: for each worker its device and its two lists of events. A copy_
    between devices runs on the source's current stream and is ordered against the destination's
    in both directions, so the worker device's current stream orders every read of its buffers,
    and a record on it after the inbox copy marks the end of the write."""

    def __init__(self, devices: list[torch.device], events: list[tuple[list, list]]):
        self.devices = devices
        self.written = [written for written, _ in events]
        self.averaged = [averaged for _, averaged in events]

    def wait_for_gradients(self, worker: int, bucket: int) -> None:
        stream = torch.cuda.current_stream(self.devices[worker])
        stream.wait_event(self.written[worker][bucket])

    def wrote_average(self, worker: int, bucket: int) -> None:
        self.averaged[worker][bucket].record(torch.cuda.current_stream(self.devices[worker]))


def worker_signals(device: torch.device, buckets: int) -> WorkerSignals:
    return CudaWorkerSignals(device, buckets) if device.type == "cuda" else HostSignals()


def server_signals(devices: list[torch.device], events: list[Any]) -> ServerSignals:
    if all(device.type == "cpu" for device in devices):
        return HostSignals()
    return CudaServerSignals(devices, events)

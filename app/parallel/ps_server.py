"""The parameter server process: broadcasts worker 0's initial weights, then runs `syncgrads`.
It imports neither timm nor the model: buckets, names and weights come from the workers, whose
`grads` and `inbox` buffers (handover.py) it maps once, at registration; the queues carry only
small messages. Each bucket is summed on its reduction device, divided by the step's images and
copied into every inbox; the reduction devices take turns over the workers' GPUs, so no single
GPU carries all the traffic.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.parallel.sync import compare_checksums
from app.parallel.buckets import split_buckets
from app.parallel.handover import ServerSignals, server_signals
from app.parallel.messages import ServerLinks
from app.parallel.packed import PackedTensors
from app.parallel.watch import Abort, SyncFailure, Watch
from app.runtime.moments import moment


@dataclass
class Registration:
    pid: int
    grads: list[torch.Tensor]  # this worker's gradient buckets, mapped into the server
    inbox: list[torch.Tensor]  # where the server writes this worker's averages
    events: Any  # what handover.server_signals needs from this worker (None on CPU)
    names: list[str]  # names of the checked tensors, for messages about diverged replicas
    state: PackedTensors | None  # worker 0's initial weights, one shared buffer


def serve(links: ServerLinks, device: str, timeout_s: float) -> None:
    """Process entry of the parameter server (a child of the driver)."""
    moment("server:start")
    if device == "cpu":
        torch.set_num_threads(1)  # it adds buffers; the cores belong to the workers
    else:
        torch.cuda.set_device(device)  # no stray context on GPU 0
    run_server(links, timeout_s)


def run_server(links: ServerLinks, timeout_s: float, signals: ServerSignals | None = None,
               abort: Abort | None = None) -> None:
    """Collect the registrations, broadcast worker 0's weights (any checkpoint restored), then
    average until every worker is done; for worker processes (`serve`) and replica threads alike."""
    watch = Watch(timeout_s=timeout_s, abort=abort)
    workers = register_workers(links, watch)
    moment("server:registered")
    for rank in range(len(workers)):
        links.send_to(rank, ("hello", os.getpid(), workers[0].state))
    workers[0] = dataclasses.replace(workers[0], state=None)  # sent: its memory can go
    syncgrads(links, watch, Reducer(workers, signals), workers[0].names)


def register_workers(links: ServerLinks, watch: Watch) -> list[Registration]:
    found: dict[int, Registration] = {}
    while len(found) < len(links.outboxes):
        message = watch.receive(links.inbox, "worker registration")
        if message[0] != "register":
            raise SyncFailure(f"expected a registration, got {message[0]!r} from worker "
                              f"{message[1]}")
        _, rank, pid, grads, inbox, sizes, events, names, state = message
        found[rank] = Registration(pid, split_buckets(grads, sizes), split_buckets(inbox, sizes),
                                   events, names, state)
        watch.peers[f"worker {rank}"] = pid
    return [found[rank] for rank in range(len(links.outboxes))]


def reduction_devices(buckets: int, worker_devices: list[torch.device]) -> list[torch.device]:
    """Bucket b is summed on the workers' distinct devices in turn."""
    distinct = list(dict.fromkeys(worker_devices))
    return [distinct[bucket % len(distinct)] for bucket in range(buckets)]


class Reducer:
    """Weighted averages of every worker's bucket, written into every worker's inbox."""

    def __init__(self, workers: list[Registration], signals: ServerSignals | None = None):
        self.grads = [w.grads for w in workers]
        self.inboxes = [w.inbox for w in workers]
        devices = [w.grads[0].device for w in workers]
        self.signals = signals or server_signals(devices, [w.events for w in workers])
        places = reduction_devices(len(workers[0].grads), devices)
        # Per bucket: the sum, and room for a bucket copied from another device before adding.
        self.sums = [torch.empty_like(g, device=place) for g, place in zip(self.grads[0], places)]
        self.staging = [torch.empty_like(s) if any(d != s.device for d in devices) else None
                        for s in self.sums]

    def __len__(self) -> int:
        return len(self.grads)

    def reduce(self, bucket: int, total: int) -> None:
        """inbox_w[b] = sum_w grads_w[b] / total, for every worker w. Gradients arrive already
        multiplied by each worker's image count."""
        for worker in range(len(self)):
            self.signals.wait_for_gradients(worker, bucket)
        out = self.sums[bucket]
        out.copy_(self.grads[0][bucket])
        for grads in self.grads[1:]:
            if grads[bucket].device == out.device:
                out.add_(grads[bucket])
            else:  # peer-to-peer onto the reduction device first (NVLink/PCIe)
                self.staging[bucket].copy_(grads[bucket])
                out.add_(self.staging[bucket])
        if total:
            out.div_(total)
        else:
            out.zero_()
        for worker, inbox in enumerate(self.inboxes):
            inbox[bucket].copy_(out)
            self.signals.wrote_average(worker, bucket)


def syncgrads(links: ServerLinks, watch: Watch, reducer: Reducer, names: list[str]) -> None:
    """The loop: average each bucket of each step once all workers have handed it over;
    answer reductions; compare replica checksums; return when every worker is done."""
    workers = len(reducer)
    arrived: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
    reductions: dict[int, dict[int, Any]] = defaultdict(dict)
    checksums: dict[int, dict[int, np.ndarray]] = defaultdict(dict)
    done: set[int] = set()
    while len(done) < workers:
        message = watch.receive(links.inbox, "message from the workers")
        kind, rank = message[0], message[1]
        if kind == "grads":
            _, _, step, bucket, weight = message
            arrived[(step, bucket)][rank] = weight
            if len(arrived[(step, bucket)]) == workers:
                total = sum(arrived.pop((step, bucket)).values())
                reducer.reduce(bucket, total)
                for other in range(workers):
                    links.send_to(other, ("avg", step, bucket, total))
        elif kind == "reduce":
            _, _, key, op, payload = message
            reductions[key][rank] = payload
            if len(reductions[key]) == workers:
                collected = reductions.pop(key)
                result = reduce_values(op, [collected[r] for r in range(workers)])
                for other in range(workers):
                    links.send_to(other, ("reduced", key, result))
        elif kind == "checksum":
            _, _, step, values = message
            checksums[step][rank] = values
            if len(checksums[step]) == workers:
                collected = checksums.pop(step)
                compare_checksums(step, [collected[r] for r in range(workers)], names)
        elif kind == "done":
            done.add(rank)
            watch.peers.pop(f"worker {rank}", None)  # it may exit now: not a failure
        else:
            raise SyncFailure(f"unexpected message {kind!r} from worker {rank}")


def reduce_values(op: str, values: list[Any]) -> Any:
    """Small reductions. Payloads are numpy arrays: they travel by value, whereas a tensor would
    travel as a shared-memory handle that dies with a sender that exits right after sending."""
    if op == "sum":
        return np.sum(values, axis=0)
    if op == "mean":
        return np.mean(values, axis=0)
    if op == "gather":
        return values
    raise SyncFailure(f"unknown reduction {op!r}")

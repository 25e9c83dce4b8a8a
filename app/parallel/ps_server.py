"""The parameter server process: broadcasts the initial weights, then runs `syncgrads`.

It imports neither timm nor the model: buckets, names and weights come from the workers.

Workers write their gradient buckets into buffers the server mapped once (shared memory on
CPU, CUDA IPC on GPU); the queues carry only small messages. For each bucket of each step the
server waits until every registered worker has handed it over, writes the weighted average into
its own shared bucket and tells every worker "bucket b of step k is ready".
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Any

import numpy as np
import torch

from app.parallel import compare_checksums
from app.parallel.watch import SyncFailure, Watch


@dataclass(frozen=True)
class ServerLinks:
    """The queues between server and workers; made by the launcher, inherited by both."""
    inbox: Queue  # workers -> server: ("register" | "grads" | "reduce" | "checksum" | "done", ...)
    outboxes: list[Queue]  # server -> worker r: ("hello" | "avg" | "reduced", ...)

    def send_to(self, rank: int, message: tuple) -> None:
        self.outboxes[rank].put(message)


def serve(links: ServerLinks, device: str, timeout_s: float) -> None:
    """Process entry of the parameter server (a child of the driver)."""
    if device == "cpu":
        torch.set_num_threads(1)  # it adds buffers; the cores belong to the workers
    run_server(links, device, timeout_s)


def run_server(links: ServerLinks, device: str, timeout_s: float) -> None:
    """Process entry: collect every worker's registration, broadcast worker 0's weights (it has
    restored any checkpoint already) together with the shared average buckets, then average
    until every worker is done."""
    watch = Watch(timeout_s=timeout_s)
    registrations = register_workers(links, watch)
    first = registrations[0]
    averages = [torch.zeros_like(b, device=device) for b in first.buckets]
    if torch.device(device).type == "cpu":
        averages = [a.share_memory_() for a in averages]
    for rank in range(len(links.outboxes)):
        links.send_to(rank, ("hello", os.getpid(), averages, first.state))
    syncgrads(links, watch, [r.buckets for r in registrations], averages, first.names)


@dataclass
class Registration:
    pid: int
    buckets: list[torch.Tensor]  # this worker's gradient buckets, mapped into the server
    names: list[str]  # parameter names, for messages about diverged replicas
    state: dict[str, torch.Tensor] | None  # worker 0's initial weights, shared memory


def register_workers(links: ServerLinks, watch: Watch) -> list[Registration]:
    found: dict[int, Registration] = {}
    while len(found) < len(links.outboxes):
        message = watch.receive(links.inbox, "worker registration")
        if message[0] != "register":
            raise SyncFailure(f"expected a registration, got {message[0]!r} from worker "
                              f"{message[1]}")
        _, rank, pid, buckets, names, state = message
        found[rank] = Registration(pid, buckets, names, state)
        watch.peers[f"worker {rank}"] = pid
    return [found[rank] for rank in range(len(links.outboxes))]


def syncgrads(links: ServerLinks, watch: Watch, worker_buckets: list[list[torch.Tensor]],
              averages: list[torch.Tensor], names: list[str]) -> None:
    """The loop: average each bucket of each step once all workers present have handed it
    over; answer reductions; compare replica checksums; return when every worker is done."""
    workers = len(worker_buckets)
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
                average_bucket(averages[bucket], [b[bucket] for b in worker_buckets], total)
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


def average_bucket(out: torch.Tensor, inputs: list[torch.Tensor], total: int) -> None:
    """out = sum(inputs) / total. Inputs are already scaled by each worker's image count."""
    out.copy_(inputs[0])
    for other in inputs[1:]:
        out.add_(other)
    if total:
        out.div_(total)
    else:
        out.zero_()
    if out.is_cuda:  # the workers read it from other processes: it must be complete
        torch.cuda.synchronize(out.device)


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

"""A worker's side of the parameter server: hand buckets over during backward, wait for the
averages, send a periodic checksum. GPU work is ordered against the server's with CUDA events
(handover.py), never a device synchronize."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.nn as nn

from app.parallel.sync import (StepImages, average_float_buffers, checked_parameters,
                               weights_checksum)
from app.parallel.buckets import BucketHooks, BucketLayout
from app.parallel.handover import WorkerSignals, worker_signals
from app.parallel.messages import ServerLinks, post
from app.parallel.packed import PackedTensors
from app.parallel.watch import SyncFailure, Watch
from app.runtime.devices import WorkerEnv


class ParameterServerSync:
    def __init__(self, links: ServerLinks, env: WorkerEnv, watch: Watch, bucket_mb: float,
                 check_every: int, signals: WorkerSignals | None = None):
        self.links = links
        self.env = env
        self.watch = watch
        self.bucket_mb = bucket_mb
        self.check_every = check_every
        self.outbox = links.outboxes[env.rank]
        self.step_index = 0  # steps since this process started (keys the messages)
        self.reduce_index = 0
        self.images = StepImages()
        self.handed_over: set[int] = set()
        self.signals = signals

    def prepare(self, model: nn.Module, ema: nn.Module | None = None) -> nn.Module:
        """Register our gradient buckets, then take the server's initial weights."""
        self.model = model
        self.checked = checked_parameters(model, ema)
        self.params = list(model.parameters())
        self.layout = BucketLayout.for_params(self.params, self.bucket_mb)
        # each side of the exchange is one flat buffer: one descriptor (or CUDA IPC handle)
        # for the server to map, however many buckets
        grads, inbox = (self.layout.allocate(self.env.device, shared=True) for _ in range(2))
        self.buckets, self.inbox = self.layout.views(grads), self.layout.views(inbox)
        self.signals = self.signals or worker_signals(torch.device(self.env.device),
                                                      len(self.layout))
        names = [name for name, _ in self.checked]
        # Worker 0's weights (a restored checkpoint included) are what the server broadcasts,
        # packed into one buffer for the same reason.
        state = PackedTensors.of(model.state_dict()) if self.env.rank == 0 else None
        self.send(("register", self.env.rank, os.getpid(), grads, inbox, self.layout.sizes,
                   self.signals.for_server(), names, state))
        _, server_pid, initial = self.receive("hello")
        self.watch.peers["parameter server"] = server_pid
        model.load_state_dict(initial.unpacked())  # copies into this replica's own tensors
        del initial  # the shared buffer is not needed any more
        self.hooks = BucketHooks(model, self.layout, self.hand_over)
        return model

    @contextlib.contextmanager
    def step(self, weight: int, last: bool = True) -> Iterator[float]:
        if self.images.add(weight, last):
            if self.step_index and self.step_index % self.check_every == 0:
                self.send_checksum()
            self.handed_over = set()
        # Accumulating micro-batches keep their gradients: buckets leave in the last backward.
        self.hooks.reset(armed=last)
        # .grad becomes (sum over images) / unit; packing multiplies by unit, the server
        # divides the sum over workers by their total images.
        yield self.images.relative(weight) or 1.0

    def hand_over(self, bucket: int) -> None:
        """Called from backward (autograd's thread) when a bucket's gradients are complete."""
        self.layout.pack(bucket, self.params, self.buckets[bucket], float(self.images.unit))
        self.signals.wrote_gradients(bucket)  # before the message that announces it
        self.handed_over.add(bucket)
        self.send(("grads", self.env.rank, self.step_index, bucket, self.images.total))

    def finish_step(self) -> int:
        for bucket in range(len(self.layout)):
            if bucket not in self.handed_over:  # no backward here, or unused parameters
                self.hand_over(bucket)
        total = 0
        for _ in range(len(self.layout)):
            _, step, bucket, total = self.receive("avg")
            if step != self.step_index:
                raise SyncFailure(f"worker {self.env.rank} expected step {self.step_index}, "
                                  f"the server answered for step {step}")
            self.signals.wait_for_average(bucket)
            self.layout.unpack(bucket, self.params, self.inbox[bucket])
        self.step_index += 1
        return total

    def send_checksum(self) -> None:
        """The weights after `step_index` updates; the server compares them across workers
        without making anybody wait."""
        checksum = weights_checksum([t for _, t in self.checked])
        self.send(("checksum", self.env.rank, self.step_index, checksum))

    def reduce(self, op: str, payload: Any) -> Any:
        key = self.reduce_index
        self.reduce_index += 1
        self.send(("reduce", self.env.rank, key, op, payload))
        _, answered, result = self.receive("reduced")
        if answered != key:
            raise SyncFailure(f"worker {self.env.rank}: reduction {key} answered as {answered}")
        return result

    def sum_across_workers(self, tensor: torch.Tensor) -> torch.Tensor:
        total = self.reduce("sum", tensor.detach().cpu().numpy())
        return torch.as_tensor(total, dtype=tensor.dtype, device=tensor.device)

    def gather(self, value: Any) -> list[Any]:
        return self.reduce("gather", value)

    def average_buffers(self, model: nn.Module) -> None:
        average_float_buffers(model, lambda flat: torch.from_numpy(
            self.reduce("mean", flat.double().cpu().numpy())))

    def send(self, message: tuple) -> None:
        post(self.links.inbox, message, "the parameter server")

    def receive(self, kind: str) -> tuple:
        message = self.watch.receive(self.outbox, f"'{kind}' from the parameter server")
        if message[0] != kind:
            raise SyncFailure(f"worker {self.env.rank} expected '{kind}', got '{message[0]}'")
        return message

    def close(self) -> None:
        self.send_checksum()  # replicas must also agree at the very end
        self.send(("done", self.env.rank))

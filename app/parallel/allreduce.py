"""All-reduce through torch.distributed: DistributedDataParallel (NCCL on GPUs, gloo on CPU),
on loopback from the driver or across machines under a launcher. Host-side numbers (image
counts, skipped-image lists) travel over a separate gloo group so they never wait on the GPU
stream.
"""

from __future__ import annotations

import contextlib
import inspect
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from app.parallel.sync import (StepImages, average_float_buffers, checked_parameters,
                               compare_checksums, scale_grads, weights_checksum)
from app.parallel.rounds import round_store
from app.runtime.devices import WorkerEnv


def no_forward_buffer_sync() -> dict[str, bool]:
    """Buffers are synced once at construction, never in forward. torch 2.14 renamed the
    option (forward_sync_buffers); older releases (2.11, for one) only know
    broadcast_buffers."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def init_distributed(env: WorkerEnv, backend: str, init_method: str, timeout_s: float) -> None:
    """init_method: the driver's tcp:// address, or env:// under torchrun, where the process
    group gets a store of this rendezvous round's own (app/parallel/rounds.py)."""
    if env.device.startswith("cuda"):
        torch.cuda.set_device(env.device)
    options: dict[str, Any] = {"init_method": init_method}
    if init_method == "env://":
        options = {"store": round_store(env.rank, env.world_size, timeout_s)}
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s), **options)


class AllReduceSync:
    def __init__(self, env: WorkerEnv, bucket_mb: float, check_every: int):
        self.env = env
        self.bucket_mb = bucket_mb
        self.check_every = check_every
        self.host_group = dist.new_group(backend="gloo")
        self.images = StepImages()  # over all workers
        self.someone_empty = False
        self.step_index = 0

    def prepare(self, model: nn.Module, ema: nn.Module | None = None) -> nn.Module:
        self.checked = checked_parameters(model, ema)
        # DDP broadcasts rank 0's parameters and buffers here; no broadcast later: BatchNorm
        # statistics are averaged before evaluation and saving (nothing to hang on).
        device_ids = [torch.device(self.env.device).index] if self.env.device.startswith(
            "cuda") else None
        self.ddp = DistributedDataParallel(model, device_ids=device_ids,
                                           bucket_cap_mb=self.bucket_mb,
                                           gradient_as_bucket_view=True, **no_forward_buffer_sync())
        return self.ddp

    @contextlib.contextmanager
    def step(self, weight: int, last: bool = True) -> Iterator[float]:
        weights = self.gather(weight)  # a host gather per micro-batch: the counts, not grads
        if self.images.add(sum(weights), last):
            if self.step_index and self.step_index % self.check_every == 0:
                self.check_replicas()
            self.step_index += 1
        # DDP averages over workers: scaling each loss by n_w x N / unit (StepImages, over all
        # workers) makes .grad the image-weighted sum / unit, which finish_step turns into the
        # mean; the factor is exactly 1.0 for full batches without accumulation.
        scale = self.images.relative(weight) * self.env.world_size
        # a worker without images cannot run DDP's backward; accumulating micro-batches keep
        # their gradients (DDP's no_sync): either way DDP does not exchange in this backward
        self.someone_empty = last and min(weights) == 0
        if self.someone_empty or not last:
            with self.ddp.no_sync():
                yield scale
        else:
            yield scale

    def finish_step(self) -> int:
        params = list(self.ddp.module.parameters())
        if self.someone_empty and self.images.total:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = self.mean_over_workers(torch.cat([g.reshape(-1) for g in grads]))
            for param, values in zip(params, flat.split([p.numel() for p in params])):
                param.grad = values.view_as(param).clone()
        scale_grads(params, self.images.to_mean())
        return self.images.total

    def sum_across_workers(self, tensor: torch.Tensor) -> torch.Tensor:
        result = tensor.clone()
        dist.all_reduce(result)
        return result

    def gather(self, value: Any) -> list[Any]:
        values: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(values, value, group=self.host_group)
        return values

    def average_buffers(self, model: nn.Module) -> None:
        average_float_buffers(model, self.mean_over_workers)

    def mean_over_workers(self, flat: torch.Tensor) -> torch.Tensor:
        """The element-wise mean over workers, in place."""
        dist.all_reduce(flat)
        return flat.div_(self.env.world_size)

    def check_replicas(self) -> None:
        """DDP keeps replicas identical by construction; this checks that it did."""
        compare_checksums(self.step_index,
                          self.gather(weights_checksum([t for _, t in self.checked])),
                          [name for name, _ in self.checked])

    def close(self) -> None:
        self.check_replicas()
        if dist.is_initialized():
            dist.destroy_process_group()

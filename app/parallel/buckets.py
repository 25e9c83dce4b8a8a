"""Gradients as a few flat buckets, filled in the order backward produces them: parameters in
reverse registration order (close to backward's) make buckets of about `bucket_mb`, and a hook
per parameter hands a bucket over once its last gradient is accumulated, while backward goes on.
Each tensor is flattened in its parameter's memory order, not logical (NCHW) order: a
channels_last gradient is packed and unpacked through views, with no reshape copy, and every
worker agrees on the order because every replica has the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn


@dataclass(frozen=True)
class BucketLayout:
    """Which parameters (by index in model.parameters()) go into which bucket."""
    buckets: tuple[tuple[int, ...], ...]
    numels: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    orders: tuple[tuple[int, ...], ...] = ()  # per parameter: its dims from outer to inner

    @classmethod
    def for_params(cls, params: list[torch.Tensor], bucket_mb: float) -> "BucketLayout":
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of several dtypes ({dtypes}) are not supported")
        limit = bucket_mb * 2**20
        buckets, current, size = [], [], 0
        for index in reversed(range(len(params))):
            current.append(index)
            size += params[index].numel() * params[index].element_size()
            if size >= limit:
                buckets.append(tuple(current))
                current, size = [], 0
        if current:
            buckets.append(tuple(current))
        numels = tuple(tuple(params[i].numel() for i in bucket) for bucket in buckets)
        return cls(tuple(buckets), numels, dtypes.pop(), tuple(map(memory_order, params)))

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Elements per bucket."""
        return tuple(sum(n) for n in self.numels)

    def allocate(self, device: torch.device | str, shared: bool) -> torch.Tensor:
        """One zeroed flat buffer for all buckets (`views` splits it): one shared-memory segment
        (CPU, `shared`) or one CUDA IPC handle for another process, however many buckets."""
        flat = torch.zeros(sum(self.sizes), dtype=self.dtype, device=device)
        if shared and torch.device(device).type == "cpu":
            flat.share_memory_()
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return split_buckets(flat, self.sizes)

    def pack(self, bucket: int, params: list[torch.Tensor], out: torch.Tensor, scale: float
             ) -> None:
        """out = scale x the bucket's gradients, flattened (zeros where a grad is missing)."""
        views = out.split(self.numels[bucket])
        for view, index in zip(views, self.buckets[bucket]):
            grad = params[index].grad
            if grad is None:
                view.zero_()
            else:
                permuted = grad.permute(self.orders[index])  # a view; contiguous as a rule
                torch.mul(permuted, scale, out=view.view(permuted.shape))

    def unpack(self, bucket: int, params: list[torch.Tensor], source: torch.Tensor) -> None:
        """Copy a flat averaged bucket into the parameters' .grad."""
        for view, index in zip(source.split(self.numels[bucket]), self.buckets[bucket]):
            param = params[index]
            if param.grad is None:
                param.grad = torch.empty_like(param)  # keeps the parameter's memory format
            permuted = param.grad.permute(self.orders[index])
            permuted.copy_(view.view(permuted.shape))


def split_buckets(flat: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """The buckets of a flat buffer, as views (the server has the sizes, not the layout)."""
    return list(flat.split(list(sizes)))


def memory_order(tensor: torch.Tensor) -> tuple[int, ...]:
    """The tensor's dims from the largest stride to the smallest: permuted into this order, a
    dense tensor of any memory format (contiguous, channels_last) is contiguous."""
    return tuple(sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), d)))


class BucketHooks:
    """Calls `on_ready(bucket)` as soon as every gradient of a bucket has been accumulated,
    while armed (disarmed: a backward whose gradients stay to accumulate)."""

    def __init__(self, model: nn.Module, layout: BucketLayout, on_ready: Callable[[int], None]):
        self.layout = layout
        self.on_ready = on_ready
        self.pending = [len(b) for b in layout.buckets]
        self.armed = True
        params = list(model.parameters())
        for bucket, members in enumerate(layout.buckets):  # for the life of the model
            for index in members:
                params[index].register_post_accumulate_grad_hook(self._hook(bucket))

    def _hook(self, bucket: int):
        def hook(_param: torch.Tensor) -> None:
            self.pending[bucket] -= 1
            if self.pending[bucket] == 0 and self.armed:
                self.on_ready(bucket)
        return hook

    def reset(self, armed: bool = True) -> None:
        self.pending = [len(b) for b in self.layout.buckets]
        self.armed = armed

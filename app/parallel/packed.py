"""Many tensors in one flat buffer, so that sharing them with another process costs one
shared-memory segment, and so one file descriptor: torch shares a CPU tensor through a
descriptor per storage, and a ResNet-50's 320 state_dict entries sent to 4 workers would pass
the 1,024 most shells allow (`ulimit -n`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes: every entry starts at an offset any dtype can be viewed at


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in bytes, into the flat buffer


@dataclass(frozen=True)
class PackedTensors:
    """Named tensors of any dtypes and shapes, copied into one uint8 buffer."""
    buffer: torch.Tensor
    entries: tuple[Entry, ...]

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], shared: bool = True) -> "PackedTensors":
        """A packed copy on the CPU; `shared` allocates it in shared memory."""
        entries, size = [], 0
        for name, tensor in tensors.items():
            entries.append(Entry(name, tensor.dtype, tuple(tensor.shape), size))
            size += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        buffer = torch.empty(size, dtype=torch.uint8)
        if shared:
            buffer.share_memory_()
        packed = cls(buffer, tuple(entries))
        with torch.no_grad():
            for view, tensor in zip(packed.unpacked().values(), tensors.values()):
                view.copy_(tensor.detach())
        return packed

    def unpacked(self) -> dict[str, torch.Tensor]:
        """Views into the buffer, by name (copy them to keep them beyond the buffer's life)."""
        views = {}
        for entry in self.entries:
            size = math.prod(entry.shape) * entry.dtype.itemsize
            raw = self.buffer[entry.offset:entry.offset + size]
            views[entry.name] = raw.view(entry.dtype).view(entry.shape)
        return views

"""Device discovery and where each worker runs. torch is imported only when a device is
actually looked up, so configuration mistakes are reported before its import cost."""

from __future__ import annotations

import os
from dataclasses import dataclass

from app.errors import UserError


@dataclass(frozen=True)
class WorkerEnv:
    """Who this worker is: built once per process and passed down, never kept in a global."""
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_primary(self) -> bool:
        """The one worker that logs and saves."""
        return self.rank == 0



def use_device(device: str, cpu_workers: int = 1) -> None:
    """First thing in a worker process: on a GPU make it the current device, so that nothing
    (the pinned-memory thread, a stray allocation) opens a context on GPU 0; on CPU share the
    cores between the CPU workers instead of fighting over them."""
    import torch  # noqa: PLC0415
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cpu_workers))


def resolve_device(name: str) -> str:
    """'auto' -> cuda:0 when a GPU is present, else cpu; checks that a named GPU exists."""
    import torch  # noqa: PLC0415
    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device '{name}'; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = device.index or 0
        if index >= count:
            raise UserError(f"device {name} not available: this machine has {count} CUDA "
                            "GPU(s); use --device cpu")
        return f"cuda:{index}"
    if device.type != "cpu":
        raise UserError(f"device type '{device.type}' is not supported; use cpu or cuda")
    return "cpu"


def worker_devices(gpus: int, devices: list[str], device: str) -> list[str]:
    """One device per worker process: --devices as given (repeats allowed), --gpus N as
    cuda:0..N-1, else the single --device."""
    if devices:
        return [resolve_device(d) for d in devices]
    if gpus:
        import torch  # noqa: PLC0415
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"--gpus {gpus}: no CUDA GPU found on this machine; for a CPU run "
                            f"with {gpus} workers use --devices {','.join(['cpu'] * gpus)}")
        if gpus > count:
            raise UserError(f"--gpus {gpus}: this machine has only {count} CUDA GPU(s)")
        return [f"cuda:{i}" for i in range(gpus)]
    return [resolve_device(device)]


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun (or any launcher following its conventions) tells this process."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int = 1  # the workers on this machine (they share its CPU cores)

    @classmethod
    def from_environ(cls, environ) -> "TorchrunEnv | None":
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return None
        try:
            return cls(int(environ["RANK"]), int(environ["WORLD_SIZE"]),
                       int(environ.get("LOCAL_RANK", "0")),
                       int(environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            raise UserError("RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be whole "
                            "numbers (set by torchrun)") from None

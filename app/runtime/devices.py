"""Device discovery, where each worker runs, and who started this process (torchrun, srun,
mpirun). torch is imported only when a device is looked up, so configuration mistakes are
reported before its import cost."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from app.runtime import mpi, slurm
from app.runtime.errors import UserError


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
    opens a context on GPU 0; on CPU share the cores between the CPU workers, never taking more
    threads than OMP_NUM_THREADS when it is set (a machine shared with other jobs)."""
    import torch  # noqa: PLC0415
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads(cpu_workers))


def cpu_threads(cpu_workers: int) -> int:
    """Each CPU worker's share of the cores, capped by OMP_NUM_THREADS."""
    share = max(1, (os.cpu_count() or 1) // cpu_workers)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(share, int(cap)) if cap.isdigit() and int(cap) > 0 else share


def resolve_device(name: str) -> str:
    """'auto' -> cuda:0 when a GPU is present, else cpu; checks that a named GPU exists."""
    if name == "cpu":  # the driver of a CPU run never imports torch
        return name
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
class LaunchEnv:
    """This process as one worker of a group a launcher started: torchrun (also inside
    Kubernetes' PyTorchJob), srun or mpirun/mpiexec."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int = 1  # the workers on this machine (they share its CPU cores)
    launcher: str = "torchrun"  # names the launcher in messages: torchrun, srun or mpirun
    init_method: str = "env://"  # torchrun's rendezvous; tcp://MASTER:PORT under srun, mpirun

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "LaunchEnv | None":
        """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) win,
        each of them, over Slurm's (torchrun inside a Slurm job, a batch script exporting
        MASTER_ADDR). An MPI launcher's ranks come before Slurm's tasks: mpirun inside an
        allocation starts its daemons with srun, and its ranks inherit the daemons' SLURM_PROCID
        and SLURM_NTASKS. A PMI rank matching the srun task around it was started by srun itself
        (`srun --mpi=pmi2`): Slurm's variables say more about it. Never an Open MPI rank: srun
        does not set OMPI_COMM_WORLD_*, and mpirun's ranks 0 and 1 of 2 on 2 nodes would match
        their daemons' step by chance. None without a launcher."""
        if "RANK" in environ and "WORLD_SIZE" in environ:
            return cls(whole(environ, "RANK"), whole(environ, "WORLD_SIZE"),
                       whole(environ, "LOCAL_RANK", "0"), whole(environ, "LOCAL_WORLD_SIZE", "1"))
        ranked, task = mpi.mpi_rank(environ), slurm.slurm_task(environ)
        srun_own = ranked and ranked.pmi and task and (task.rank, task.world_size) == (
            ranked.rank, ranked.world_size)
        if ranked and not srun_own:
            host, port = mpi.meeting_point(ranked, environ)
            return cls(ranked.rank, ranked.world_size, ranked.local_rank,
                       ranked.local_world_size or 1, launcher="mpirun",
                       init_method=f"tcp://{bracketed(host)}:{port}")
        if task is None:
            return None
        host = environ.get("MASTER_ADDR") or task.master_host
        port = whole(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else \
            slurm.job_port(task.job_id)
        return cls(whole(environ, "RANK", str(task.rank)), task.world_size,
                   whole(environ, "LOCAL_RANK", str(task.local_rank)), task.local_world_size,
                   launcher="srun", init_method=f"tcp://{bracketed(host)}:{port}")

    def check_one_device_each(self, gpus: int, devices: list[str]) -> None:
        """The launcher started one process per GPU: a process cannot start more workers."""
        if not gpus and len(devices) <= 1:
            return
        flag = f"--gpus {gpus}" if gpus else f"--devices {','.join(devices)}"
        how = {"srun": "ask srun for them: --ntasks-per-node N --gpus-per-task 1",
               "mpirun": "start one rank per GPU: mpirun -n N"}.get(
                   self.launcher, "give torchrun --nproc-per-node N")
        raise UserError(f"{flag} conflicts with {self.launcher}, which started this process as "
                        f"one of {self.world_size} workers with one device each; drop {flag} "
                        f"and {how}")

    def device(self, requested: str, visible_gpus: int, bound: bool) -> str:
        """This worker's device: cpu when asked for (or without a GPU), else its own GPU:
        cuda:LOCAL_RANK where it sees the node's GPUs (torchrun; srun --gpus-per-node), cuda:0
        where it is bound to its own (`bound`: srun --gpus-per-task 1, or --gpu-bind)."""
        if requested == "cpu" or visible_gpus == 0:
            return "cpu"
        if self.local_rank < visible_gpus:
            return f"cuda:{self.local_rank}"
        if visible_gpus == 1 or bound:
            return "cuda:0"
        raise UserError(f"local rank {self.local_rank} sees only {visible_gpus} GPUs: start "
                        "one task per GPU (srun --gpus-per-task 1, or --ntasks-per-node equal "
                        "to the GPUs per node)")


def bracketed(host: str) -> str:
    """An IPv6 address in a tcp:// URL goes in brackets."""
    return f"[{host}]" if ":" in host else host


def whole(environ: Mapping[str, str], name: str, default: str | None = None) -> int:
    value = environ[name] if default is None else environ.get(name, default)
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name}={value!r} must be a whole number (set by the launcher)"
                        ) from None

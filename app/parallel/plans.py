"""How a worker reaches its peers: one entry per sync mode in SYNC_MODES. The driver makes a
plan before it spawns anything; the plan (picklable) travels to every worker, where
`plan.connect(env)` returns the loop's GradientSync. A mode may also run helper processes
beside the workers (the parameter server).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from app.config import ParallelConfig
from app.parallel.messages import ServerLinks
from app.parallel.watch import Abort, Watch
from app.runtime.devices import LaunchEnv, WorkerEnv
from app.runtime.errors import UserError
from app.runtime.forkserver import ByName
from app.runtime.interrupts import SharedRequests

if TYPE_CHECKING:
    from app.parallel.sync import GradientSync


class SyncPlan(Protocol):
    requests: SharedRequests | None  # the driver's save/stop requests (None: no driver)

    def connect(self, env: WorkerEnv) -> GradientSync: ...


@dataclass(frozen=True)
class LocalPlan:
    """One worker in the driver's own process."""
    requests: SharedRequests | None = None

    def connect(self, env: WorkerEnv) -> GradientSync:
        from app.parallel.sync import LocalSync  # noqa: PLC0415 (the driver imports no torch)
        return LocalSync()


@dataclass(frozen=True)
class PsPlan:
    links: ServerLinks
    config: ParallelConfig  # bucket size, checksum interval, timeout
    requests: SharedRequests | None = None
    abort: Abort | None = None  # replicas that are threads (threads.py): how they are stopped

    def connect(self, env: WorkerEnv) -> GradientSync:
        from app.parallel.ps_worker import ParameterServerSync  # noqa: PLC0415
        watch = Watch(timeout_s=self.config.sync_timeout, abort=self.abort)
        return ParameterServerSync(self.links, env, watch, self.config.bucket_mb,
                                   self.config.check_every)


@dataclass(frozen=True)
class AllReducePlan:
    init_method: str  # tcp://HOST:PORT from the driver or srun, env:// under torchrun
    backend: str
    config: ParallelConfig
    requests: SharedRequests | None = None

    def connect(self, env: WorkerEnv) -> GradientSync:
        from app.parallel.allreduce import AllReduceSync, init_distributed  # noqa: PLC0415
        init_distributed(env, self.backend, self.init_method, self.config.sync_timeout)
        return AllReduceSync(env, self.config.bucket_mb, self.config.check_every)


@dataclass(frozen=True)
class Helper:
    """A process a mode runs beside the workers: `target(*args)` in a child of the driver."""
    name: str
    target: ByName
    args: tuple


@dataclass(frozen=True)
class Setup:
    plan: SyncPlan
    helpers: list[Helper] = field(default_factory=list)


def local_setup(context: Any, devices: list[str], config: ParallelConfig,
                requests: SharedRequests | None) -> Setup:
    return Setup(LocalPlan(requests))


def ps_setup(context: Any, devices: list[str], config: ParallelConfig,
             requests: SharedRequests | None) -> Setup:
    links = ServerLinks(context.Queue(), [context.Queue() for _ in devices])
    server = Helper(f"parameter server ({devices[0]})", ByName("app.parallel.ps_server", "serve"),
                    (links, devices[0], config.sync_timeout))
    return Setup(PsPlan(links, config, requests), [server])


def backend_for(devices: list[str]) -> str:
    """NCCL needs one GPU per process; CPU workers and several workers on one GPU use gloo."""
    if all(d.startswith("cuda") for d in devices) and len(set(devices)) == len(devices):
        return "nccl"
    return "gloo"


def free_port() -> int:
    """A port for a loopback rendezvous (tcp://127.0.0.1:PORT)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def allreduce_setup(context: Any, devices: list[str], config: ParallelConfig,
                    requests: SharedRequests | None) -> Setup:
    return Setup(AllReducePlan(f"tcp://127.0.0.1:{free_port()}", backend_for(devices), config,
                               requests))


@dataclass(frozen=True)
class SyncMode:
    setup: Callable[[Any, list[str], ParallelConfig, SharedRequests | None], Setup]
    in_process: bool = False  # the single worker runs in the driver's own process


SYNC_MODES: dict[str, SyncMode] = {
    "local": SyncMode(local_setup, in_process=True),
    "ps": SyncMode(ps_setup),
    "allreduce": SyncMode(allreduce_setup),
}


def choose_sync(requested: str, devices: list[str], launch: LaunchEnv | None) -> str:
    """The mode to run: `auto` is the parameter server on one machine, all-reduce under
    torchrun or srun, and no sync at all for a single worker."""
    if requested != "auto" and requested not in SYNC_MODES:
        raise UserError(f"unknown --sync mode '{requested}'; known: auto, "
                        f"{', '.join(m for m in SYNC_MODES if m != 'local')}")
    if launch:
        if requested not in ("auto", "allreduce"):
            raise UserError(f"--sync {requested} runs on one machine; under {launch.launcher} "
                            "use --sync allreduce")
        return "allreduce"
    if len(devices) == 1:
        return "local"
    return "ps" if requested == "auto" else requested


def launched_plan(device: str, config: ParallelConfig, init_method: str) -> AllReducePlan:
    """Under torchrun the process group comes from torchrun's environment (env://); under
    srun from task 0's address (tcp://), which every task derived from Slurm's variables."""
    return AllReducePlan(init_method, backend_for([device]), config)

"""Starting and watching the worker processes (and the parameter server).

The driver spawns every process (spawn, not fork: fork breaks CUDA and s3fs) and then only
watches: if any process dies, all others are stopped within seconds and the driver exits
non-zero naming the process and how it ended. SIGINT/SIGTERM to the driver stop everything.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from app.config import ParallelConfig
from app.devices import TorchrunEnv, WorkerEnv
from app.errors import USER_ERROR_EXIT_CODE, UserError
from app.job import TrainJob
from app.interrupts import (PREEMPTED_EXIT_CODE, STOP_SIGNALS, AgreedRequests, Interval,
                            SharedRequests)
from app.loggers import NullLogger, build_loggers
from app.parallel import GradientSync, LocalSync
from app.parallel.watch import POLL_S, SyncFailure, Watch, descendants, die_with_parent, is_alive

log = logging.getLogger("imagenet_dp")
STOP_GRACE_S = 3.0  # SIGTERM, then SIGKILL after this long


def choose_sync(requested: str, devices: list[str], torchrun: TorchrunEnv | None) -> str:
    if torchrun:
        if requested == "ps":
            raise UserError("--sync ps runs on one machine; under torchrun use --sync allreduce")
        return "allreduce"
    if len(devices) == 1:
        return "local"
    return "ps" if requested == "auto" else requested


# --- how a worker reaches its peers ---------------------------------------------------------

@dataclass(frozen=True)
class LocalPlan:
    """One worker in the driver's own process."""
    requests: Any = None

    def connect(self, env: WorkerEnv) -> GradientSync:
        return LocalSync()


@dataclass(frozen=True)
class PsPlan:
    links: Any  # ServerLinks
    bucket_mb: float
    check_every: int
    timeout_s: float
    requests: Any = None  # SharedRequests from the driver

    def connect(self, env: WorkerEnv) -> GradientSync:
        from app.parallel.ps_worker import ParameterServerSync  # noqa: PLC0415
        return ParameterServerSync(self.links, env, Watch(timeout_s=self.timeout_s),
                                   self.bucket_mb, self.check_every)


@dataclass(frozen=True)
class AllReducePlan:
    init_method: str
    backend: str
    bucket_mb: float
    check_every: int
    timeout_s: float
    requests: Any = None  # SharedRequests from the driver; None under torchrun

    def connect(self, env: WorkerEnv) -> GradientSync:
        from app.parallel.allreduce import AllReduceSync, init_distributed  # noqa: PLC0415
        init_distributed(env, self.backend, self.init_method, self.timeout_s)
        return AllReduceSync(env, self.bucket_mb, self.check_every)


# --- what runs in each process ----------------------------------------------------------

def train_process(job: TrainJob, env: WorkerEnv, plan: Any, cpu_workers: int = 1) -> int:
    """One worker: connect to the peers, train, say goodbye. Only the primary logs.
    Returns 0, or PREEMPTED_EXIT_CODE when it stopped on request after saving."""
    from app.train import train_worker  # noqa: PLC0415 (torch-heavy; children only)
    if env.device == "cpu":  # share the cores between the CPU workers instead of fighting
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cpu_workers))
    sync = plan.connect(env)
    # Without a driver above the workers (one process, torchrun), each process listens for
    # signals itself and the workers agree every step.
    own = None if plan.requests else AgreedRequests(sync, env.world_size,
                                                    job.config.run.checkpoint_interval)
    loggers = build_loggers(job) if env.is_primary else NullLogger()
    try:
        if env.is_primary:
            loggers.log_config(job.config.to_dict())
        result = train_worker(job, env, sync, loggers, plan.requests or own)
    finally:
        loggers.finish()
        if own:
            own.restore()
    sync.close()
    return PREEMPTED_EXIT_CODE if "stopped_at_step" in result else 0


def server_process(links: Any, device: str, timeout_s: float) -> None:
    from app.parallel.ps_server import run_server  # noqa: PLC0415
    if device == "cpu":
        torch.set_num_threads(1)  # it adds buffers; the cores belong to the workers
    run_server(links, device, timeout_s)


def child_entry(name: str, target: Callable, args: tuple, reports: Any) -> None:
    """Wraps every child: dies with the driver, leaves Ctrl-C to the driver, and reports why
    it failed before exiting non-zero."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        code = target(*args)
    except UserError as error:
        reports.put((name, str(error), "user"))
        sys.exit(USER_ERROR_EXIT_CODE)
    except SyncFailure as error:
        reports.put((name, str(error), "sync"))
        sys.exit(1)
    except BaseException as error:  # noqa: BLE001 (reported to the driver, then re-raised)
        traceback.print_exc()
        reports.put((name, f"{type(error).__name__}: {error}".splitlines()[0][:300], "crash"))
        sys.exit(1)
    sys.exit(code or 0)


# --- the driver side --------------------------------------------------------------------

@dataclass
class Child:
    name: str
    process: Any  # multiprocessing.Process


def run_job(job: TrainJob, devices: list[str], mode: str) -> int:
    return launch(train_process, job, devices, mode, job.config.parallel,
                  Stopping(job.config.run.checkpoint_interval, job.config.run.stop_timeout))


@dataclass(frozen=True)
class Stopping:
    """When the driver asks its workers to save (minutes; 0 = never) and how long it waits for
    the checkpoint after a signal before it kills them (seconds)."""
    checkpoint_interval: float = 0.0
    stop_timeout: float = 0.0


def launch(target: Callable, job: Any, devices: list[str], mode: str,
           config: ParallelConfig, stopping: Stopping = Stopping()) -> int:
    """Run `target(job, env, plan, cpu_workers)` once per device: in this process for a single
    device, else in spawned processes (plus the parameter server for ps). Returns the exit
    code: 0, PREEMPTED_EXIT_CODE (stopped on request with a checkpoint), or a failure's."""
    if mode == "local":
        return target(job, WorkerEnv(rank=0, world_size=1, device=devices[0]), LocalPlan(),
                      1) or 0
    # After a failure the queues of killed processes are cleaned up by multiprocessing's
    # resource tracker, which then warns about "leaked semaphores": expected, not a leak here.
    os.environ.setdefault("PYTHONWARNINGS", "ignore:resource_tracker:UserWarning")
    context = mp.get_context("spawn")
    reports = context.Queue()
    requests = SharedRequests(context, len(devices))
    children: list[Child] = []
    if mode == "ps":
        from app.parallel.ps_server import ServerLinks  # noqa: PLC0415
        links = ServerLinks(context.Queue(), [context.Queue() for _ in devices])
        plan: Any = PsPlan(links, config.bucket_mb, config.check_every, config.timeout_s,
                           requests)
        name = f"parameter server ({devices[0]})"
        children.append(Child(name, context.Process(
            target=child_entry,
            args=(name, server_process, (links, devices[0], config.timeout_s), reports))))
    else:
        from app.parallel.allreduce import backend_for  # noqa: PLC0415
        plan = AllReducePlan(f"tcp://127.0.0.1:{free_port()}", backend_for(devices),
                             config.bucket_mb, config.check_every, config.timeout_s, requests)
    cpu_workers = devices.count("cpu")
    for rank, device in enumerate(devices):
        env = WorkerEnv(rank=rank, world_size=len(devices), device=device)
        name = f"worker {rank} ({device})"
        children.append(Child(name, context.Process(
            target=child_entry, args=(name, target, (job, env, plan, cpu_workers), reports))))
    for child in children:
        child.process.start()
    log.info("started %s: %s", mode, ", ".join(f"{c.name} pid {c.process.pid}" for c in children))
    return supervise(children, reports, requests, stopping)


def run_torchrun(job: TrainJob, torchrun: TorchrunEnv, device: str) -> int:
    """Under torchrun this process is one worker; torchrun watches the processes."""
    env = WorkerEnv(rank=torchrun.rank, world_size=torchrun.world_size, device=device)
    config = job.config.parallel
    backend = "nccl" if device.startswith("cuda") else "gloo"
    plan = AllReducePlan("env://", backend, config.bucket_mb, config.check_every,
                         config.timeout_s)
    return train_process(job, env, plan)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class StopSignals:
    """Turns SIGINT/SIGTERM into a flag the supervising loop acts on at once: the handler also
    writes to a pipe that the loop waits on beside the children."""

    def __init__(self):
        self.received: int | None = None
        self.count = 0
        self.wakeup, self._notify = os.pipe()
        for fd in (self.wakeup, self._notify):
            os.set_blocking(fd, False)
        self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}

    def handle(self, signum, _frame) -> None:
        self.received = signum
        self.count += 1
        try:
            os.write(self._notify, b"!")
        except BlockingIOError:  # the pipe is full of earlier wake-ups: awake anyway
            pass

    def clear(self) -> None:
        try:
            while os.read(self.wakeup, 512):
                pass
        except BlockingIOError:
            pass

    def name(self) -> str:
        return signal.Signals(self.received).name

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        os.close(self.wakeup)
        os.close(self._notify)


def supervise(children: list[Child], reports: Any, requests: SharedRequests,
              stopping: Stopping) -> int:
    """Wait for all children to finish. On the first failure, stop them all. On a signal, ask
    the workers to save and stop at the next step, and wait for that up to stop_timeout; a
    second signal (or the timeout) stops them at once."""
    signals = StopSignals()
    interval = Interval(stopping.checkpoint_interval)
    deadline = None
    try:
        while True:
            running = [c.process.sentinel for c in children if c.process.exitcode is None]
            if running:
                connection.wait([*running, signals.wakeup], timeout=POLL_S)
                signals.clear()
            if signals.received and deadline is None:
                step = requests.ask(stop=True)
                deadline = time.monotonic() + (stopping.stop_timeout if step is not None else 0)
                if step is not None:
                    print(f"{signals.name()}: saving a checkpoint after step {step}, then "
                          "stopping (send it again to stop at once)", file=sys.stderr)
            timed_out = deadline is not None and time.monotonic() > deadline
            if signals.count > 1 or timed_out:
                stop_all(children)
                why = "" if signals.count > 1 else \
                    f" (none within --stop-timeout {stopping.stop_timeout:g} s)"
                print(f"stopped by {signals.name()}: ended all {len(children)} processes "
                      f"without a new checkpoint{why}", file=sys.stderr)
                return 128 + signals.received
            failed = [c for c in children
                      if c.process.exitcode not in (None, 0, PREEMPTED_EXIT_CODE)]
            if failed:
                stop_all(children)
                return report_failure(failed, drain(reports))
            if not running:
                codes = {c.process.exitcode for c in children}
                return PREEMPTED_EXIT_CODE if PREEMPTED_EXIT_CODE in codes else 0
            if deadline is None and interval.due():
                requests.ask(stop=False)
    finally:
        signals.restore()


def drain(reports: Any) -> dict[str, tuple[str, str]]:
    found = {}
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            name, message, kind = reports.get(timeout=0.1)
        except Exception:  # noqa: BLE001 (queue.Empty; the queue module is not exported)
            break
        found.setdefault(name, (message, kind))
    return found


def report_failure(failed: list[Child], reports: dict[str, tuple[str, str]]) -> int:
    """Name the root cause: a process that was killed, crashed or hit a user error comes
    before those that only noticed a peer was gone."""
    def only_noticed(child: Child) -> bool:
        return reports.get(child.name, ("", ""))[1] == "sync"
    child = sorted(failed, key=only_noticed)[0]
    code = child.process.exitcode
    message, kind = reports.get(child.name, ("", ""))
    if code < 0:
        cause = f"was killed by {signal.Signals(-code).name}"
        if -code == signal.SIGKILL:
            cause += " (by a user or the out-of-memory killer)"
    elif message:
        cause = f"failed: {message}"
    else:
        cause = f"exited with code {code}"
    print(f"error: {child.name} {cause}; stopped the other processes", file=sys.stderr)
    return USER_ERROR_EXIT_CODE if kind == "user" else 1


def stop_all(children: list[Child]) -> None:
    """SIGTERM every child, SIGKILL what is left after STOP_GRACE_S, including grandchildren
    (data loader workers) found before their parents went away."""
    alive = [c.process for c in children if c.process.exitcode is None]
    below = [pid for p in alive for pid in descendants(p.pid)]
    for process in alive:
        process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in alive:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in alive:
        if process.exitcode is None:
            process.kill()
            process.join(timeout=STOP_GRACE_S)
    for pid in below:
        if is_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

"""One training worker, assembled in its own process: connect to the peers, build the loggers
(the primary only), train, say goodbye. The launcher (app/parallel/launcher.py) starts it;
torchrun or srun starts it directly."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from app.loggers import Logger, NullLogger, build_loggers
from app.data.loader_processes import loader_death
from app.loggers.relay import RelayLogger
from app.parallel.plans import SyncPlan, launched_plan
from app.parallel.watch import SyncFailure, peer_loss_as_sync_failure
from app.runtime.devices import LaunchEnv, WorkerEnv, use_device
from app.runtime.interrupts import AgreedRequests
from app.runtime.moments import moment
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE, stop_signals
from app.training.job import TrainJob
from app.training.parts import ConfigParts, Parts
from app.training.trainer import Stopped, train_worker
from app.training.user_parts import UserParts


def train_process(job: TrainJob, env: WorkerEnv, plan: SyncPlan, cpu_workers: int = 1) -> int:
    """The driver's worker: the config's parts, the loggers built here (the primary's).
    Returns 0, or PREEMPTED_EXIT_CODE when it stopped on request after saving."""
    moment("worker:start")
    code = run_replica(job, env, plan, cpu_workers, ConfigParts(),
                       lambda: build_loggers(job.run_info()))
    moment("worker:end")
    return code


@dataclass(frozen=True)
class ApiJob:
    """What a replica of app.train receives (in a thread, or pickled into a process)."""
    job: TrainJob
    parts: UserParts
    relay: Any  # the queue the primary's log records go to, delivered in the caller's thread


def api_replica(api: ApiJob, env: WorkerEnv, plan: SyncPlan, cpu_workers: int = 1) -> int:
    """A replica of app.train: the caller's parts; the primary relays its log records."""
    return run_replica(api.job, env, plan, cpu_workers, api.parts, lambda: RelayLogger(api.relay))


class LoaderDied(SyncFailure):
    """One of this worker's loader processes died (the out-of-memory killer, a user)."""
    noticed_only = False  # the cause is here, not in a peer


@peer_loss_as_sync_failure()
def run_replica(job: TrainJob, env: WorkerEnv, plan: SyncPlan, cpu_workers: int, parts: Parts,
                primary_logger: Callable[[], Logger]) -> int:
    """A loader's death reaches this process as an error from wherever it was (its SIGCHLD
    handler interrupts any code): whatever the error, a dead loader of this worker is its cause."""
    try:
        return train_replica(job, env, plan, cpu_workers, parts, primary_logger)
    except (RuntimeError, OSError, EOFError) as error:
        cause = loader_death(error)
        if cause is None:
            raise
        raise LoaderDied(cause) from None


def train_replica(job: TrainJob, env: WorkerEnv, plan: SyncPlan, cpu_workers: int, parts: Parts,
                  primary_logger: Callable[[], Logger]) -> int:
    use_device(env.device, cpu_workers)
    sync = plan.connect(env)
    # Without a driver above the workers (one process, torchrun, srun), each process takes its
    # own stop requests and the workers agree at every point.
    requests = plan.requests or AgreedRequests(sync, env.world_size,
                                               job.config.run.checkpoint_interval, stop_signals())
    loggers = primary_logger() if env.is_primary else NullLogger()
    try:
        if env.is_primary:
            loggers.log_config(job.config.to_dict())
        outcome = train_worker(job, env, sync, loggers, requests, parts)
    finally:
        loggers.finish()
    sync.close()
    return PREEMPTED_EXIT_CODE if isinstance(outcome, Stopped) else 0


def launched_process(job: TrainJob, launch: LaunchEnv, device: str) -> int:
    """Under torchrun, srun or mpirun this process is one worker, and the launcher watches the
    processes (restarts them, or ends the step or the job, when one fails)."""
    env = WorkerEnv(rank=launch.rank, world_size=launch.world_size, device=device)
    try:
        code = train_process(job, env, launched_plan(device, job.config.parallel,
                                                     launch.init_method),
                             cpu_workers=launch.local_world_size)
    except SyncFailure as failure:  # the launcher names the rank that died; this one lost it
        if not ((signals := stop_signals()) and signals.received):
            print(f"error: rank {env.rank}: {failure}", file=sys.stderr)
            return 1
        # stopped on request: its peers, asked too, may have ended first
        print(f"stopped by {signals.name()} at once: {failure}", file=sys.stderr)
        code = PREEMPTED_EXIT_CODE
    if code == PREEMPTED_EXIT_CODE and launch.launcher == "mpirun" and env.rank:
        # mpirun ends the whole job when a rank exits non-zero: rank 0, which has the
        # checkpoint by now, says 75 for all, after printing how to continue
        return 0
    return code

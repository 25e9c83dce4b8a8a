"""Replicas as threads of one process: a thread per device, and the parameter server's
`syncgrads` loop as one more thread, over `queue.Queue`s: nothing is pickled (a model, loss or
schedule defined in a notebook trains), and the server thread reads and writes the replicas'
own buckets in place. Threads cannot be killed: a replica that fails, or a stop that cannot
wait, sets an `Abort` that ends every other wait within POLL_S (watch.py).
"""

from __future__ import annotations

import multiprocessing
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from app.config import ParallelConfig
from app.parallel.messages import ServerLinks
from app.parallel.plans import LocalPlan, PsPlan
from app.parallel.ps_server import run_server
from app.parallel.stopping import Stopping, StopLoop
from app.parallel.watch import Abort, SyncFailure
from app.runtime.devices import WorkerEnv
from app.runtime.errors import UserError, first_line
from app.runtime.interrupts import SharedRequests
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE, raising_from, stop_signals


def in_process_requests(replicas: int) -> SharedRequests:
    """The driver's save/stop agreement, between threads. Made with the fork context only for
    its primitives: fork unlinks a semaphore's name at once, where spawn's would start
    multiprocessing's resource tracker, a process left behind. Nothing is forked."""
    return SharedRequests(multiprocessing.get_context("fork"), replicas)


@dataclass
class Member:
    """A thread of the group, and how it ended."""
    name: str
    thread: threading.Thread
    result: Any = None
    error: BaseException | None = None

    @property
    def failed_first(self) -> bool:
        """Failed for a reason of its own, not because it noticed another one's failure."""
        return self.error is not None and not (isinstance(self.error, SyncFailure)
                                               and self.error.noticed_only)


@dataclass
class ThreadGroup:
    """The replica threads and the server thread, started together."""
    members: list[Member] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)
    order: list[Member] = field(default_factory=list)  # in the order they ended

    def add(self, name: str, target: Callable, args: tuple) -> Member:
        member = Member(name, threading.Thread(name=name, daemon=True))
        member.thread.run = lambda: self._run(member, target, args)  # type: ignore[method-assign]
        self.members.append(member)
        return member

    def _run(self, member: Member, target: Callable, args: tuple) -> None:
        try:
            member.result = target(*args)
        except BaseException as error:  # noqa: BLE001 (handed to the caller's thread)
            member.error = error
        finally:
            self.order.append(member)
            self.ended.set()

    def running(self) -> list[Member]:
        return [m for m in self.members if m.thread.is_alive()]

    def first_failure(self) -> Member | None:
        """The member whose failure came first and was its own, else the first that failed."""
        failed = [m for m in self.order if m.error is not None]
        own = [m for m in failed if m.failed_first]
        return (own or failed or [None])[0]


def start_group(target: Callable, job: Any, devices: list[str], config: ParallelConfig,
                requests: SharedRequests, abort: Abort) -> ThreadGroup:
    """`target(job, env, plan, cpu_replicas)` in a thread per device, and, for more than one,
    the server thread."""
    group = ThreadGroup()
    plan: LocalPlan | PsPlan = LocalPlan(requests)  # a single replica: nothing to agree on
    if len(devices) > 1:
        links = ServerLinks(queue.Queue(), [queue.Queue() for _ in devices])
        group.add("parameter server (thread)", run_server,
                  (links, config.sync_timeout, None, abort))
        plan = PsPlan(links, config, requests, abort)  # the server thread's queues
    cpu_replicas = devices.count("cpu")
    for rank, device in enumerate(devices):
        env = WorkerEnv(rank=rank, world_size=len(devices), device=device)
        group.add(f"replica {rank} ({device})", target, (job, env, plan, cpu_replicas))
    for member in group.members:
        member.thread.start()
    return group


TICK_S = 0.1  # how often the caller's thread looks at the group, its signals and its on_tick
ABORT_GRACE_S = 30.0  # an aborted replica ends at its next wait: at most a step away


def run_threads(target: Callable, job: Any, devices: list[str], config: ParallelConfig,
                stopping: Stopping = Stopping(), on_tick: Callable[[], None] = lambda: None
                ) -> int:
    """The counterpart of launcher.launch for threads, watched from the caller's thread, which
    calls `on_tick` every TICK_S. A stop request (a notebook's interrupt is SIGINT) is the stop
    loop's (app/parallel/stopping.py); where it ends the group, the replicas end at their next
    wait or point, without a new checkpoint. Returns 0 or PREEMPTED_EXIT_CODE; a replica's own
    error is raised here, naming the replica."""
    requests, abort = in_process_requests(len(devices)), Abort()
    cpu_threads = torch.get_num_threads()  # each CPU replica sets its share in its thread
    loop = StopLoop(requests, stopping, stop_signals())
    try:
        with raising_from(0):
            group = start_group(target, job, devices, config, requests, abort)
            try:
                watch_group(group, abort, loop, on_tick)
            except BaseException:  # the caller's own failure (a logger): end all
                abort.set("stopped: the caller failed")
                for member in group.members:
                    member.thread.join(ABORT_GRACE_S)
                raise
    finally:
        torch.set_num_threads(cpu_threads)
    return outcome(group, loop, abort)


def watch_group(group: ThreadGroup, abort: Abort, loop: StopLoop,
                on_tick: Callable[[], None]) -> None:
    aborted_at = None
    while group.running():
        group.ended.wait(TICK_S)
        group.ended.clear()
        on_tick()
        failure = group.first_failure()
        if failure and not abort.is_set():
            abort.set(f"stopped: {failure.name} failed")
        why = loop.tick() if not abort.is_set() else None
        if why:  # said now: the replicas end at their next wait or point
            abort.set(loop.ended(why, f"all {len(group.members)} threads"))
            print(abort.reason, file=sys.stderr)
        if abort.is_set():
            now = time.monotonic()
            aborted_at = aborted_at or now
            if now - aborted_at > ABORT_GRACE_S:
                names = ", ".join(m.name for m in group.running())
                raise SyncFailure(f"{names} did not stop within {ABORT_GRACE_S:.0f} s of "
                                  f"'{abort.reason}' (left running as daemon threads)")
    on_tick()


def outcome(group: ThreadGroup, loop: StopLoop, abort: Abort) -> int:
    failure = group.first_failure()
    stopped = loop.signals is not None and loop.signals.received is not None
    if failure and failure.failed_first:
        if not stopped:
            raise_in_caller(failure)
        print(f"{failure.name} failed while the run stopped: "
              f"{first_line(failure.error, 300, with_type=True)}", file=sys.stderr)
    if stopped:
        return PREEMPTED_EXIT_CODE
    if failure:
        raise_in_caller(failure)
    codes = {member.result for member in group.members}
    return PREEMPTED_EXIT_CODE if PREEMPTED_EXIT_CODE in codes else 0


def raise_in_caller(member: Member) -> None:
    """The replica's own exception, naming the replica: a UserError stays one line."""
    error = member.error
    if isinstance(error, UserError):
        raise UserError(f"{member.name}: {error}") from None
    if isinstance(error, SyncFailure):
        raise type(error)(f"{member.name}: {error}") from None
    error.add_note(f"(raised in {member.name}; every other replica was stopped)")
    raise error

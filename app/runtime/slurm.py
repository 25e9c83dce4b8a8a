"""Slurm's view of this process, read from the variables srun sets for each task it starts.

`srun --ntasks-per-node 8 --gpus-per-task 1 python bin/driver.py ...` starts every worker
itself (no torchrun): SLURM_PROCID is the rank, the step's task count the world size. Task 0
serves the process group's store on the first host of the step's node list, at a port derived
from the job id, so every task finds it without any exchange or scontrol. devices.py decides
which source wins.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Mapping

from app.runtime.errors import UserError

# Unprivileged and below Linux's ephemeral range (32768-60999); two jobs on one node collide
# only when their ids are 20000 apart, and MASTER_PORT overrides it.
PORT_BASE, PORT_SPAN = 10000, 20000
# The node lists, most specific first: srun sets the step's (task 0 runs on its first node);
# SLURM_JOB_NODELIST is the allocation's, SLURM_NODELIST its older name.
NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
# The task count: srun sets the step's under both names; SLURM_NPROCS is the old name.
TASK_COUNTS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")


@dataclass(frozen=True)
class SlurmTask:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_host: str  # the first host of the step's node list
    job_id: str


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order: `gpu[001-003,010],cpu7` ->
    gpu001, gpu002, gpu003, gpu010, cpu7; several bracket groups expand as a product, the last
    fastest (`r[1-2]n[1-2]` -> r1n1, r1n2, r2n1, r2n2)."""
    hosts = []
    for name in split_outside_brackets(text.strip()):
        if not name:
            raise UserError(f"host list '{text}' has an empty entry")
        hosts.extend(expand_name(name, text))
    return hosts


def split_outside_brackets(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts


def expand_name(name: str, whole: str) -> list[str]:
    match = re.match(r"([^\[\]]*)\[([^\[\]]*)\](.*)$", name)
    if not match:
        if "[" in name or "]" in name:
            raise UserError(f"host list '{whole}': unbalanced brackets in '{name}'")
        return [name]
    prefix, ranges, rest = match.groups()
    tails = expand_name(rest, whole) if rest else [""]
    return [f"{prefix}{number}{tail}" for number in expand_ranges(ranges, whole)
            for tail in tails]


def expand_ranges(ranges: str, whole: str) -> list[str]:
    """`001-003,010` -> 001, 002, 003, 010."""
    numbers = []
    for part in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match:
            raise UserError(f"host list '{whole}': cannot read the range '{part}'")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise UserError(f"host list '{whole}': the range '{part}' runs backwards")
        width = len(low) if low.startswith("0") else 0
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return numbers


def expand_counts(text: str) -> list[int]:
    """Slurm's per-node counts (SLURM_TASKS_PER_NODE): `2(x3),1` -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise UserError(f"tasks per node '{text}': cannot read '{part}'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def job_port(job_id: str) -> int:
    """The rendezvous port every task of job `job_id` derives alike."""
    return PORT_BASE + whole_number("SLURM_JOB_ID", job_id) % PORT_SPAN


def is_srun_task(environ: Mapping[str, str]) -> bool:
    """A task srun started. The batch script itself also carries SLURM_PROCID (0) and the
    job's SLURM_NTASKS, but neither SLURM_STEP_ID (srun sets it for every task it starts) and
    it has ENVIRONMENT=BATCH (which srun's tasks inherit, hence checked second)."""
    if "SLURM_PROCID" not in environ:
        return False
    if "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ:
        return True
    return environ.get("ENVIRONMENT") != "BATCH"


def slurm_task(environ: Mapping[str, str]) -> SlurmTask | None:
    """This process as one of several tasks of an srun step, or None: not under srun, or
    the only task (then the driver starts its own workers, e.g. `srun -n1 ... --gpus 8`)."""
    if not is_srun_task(environ):
        return None
    world_size = whole_number(*first_of(environ, TASK_COUNTS, default="1"))
    if world_size < 2:
        return None
    nodelist = first_of(environ, NODELISTS, default="")
    if not nodelist[1]:
        raise UserError("under srun but no SLURM_JOB_NODELIST: cannot tell where task 0 runs "
                        "(set MASTER_ADDR)")
    rank = whole_number("SLURM_PROCID", environ["SLURM_PROCID"])
    return SlurmTask(rank=rank, world_size=world_size,
                     local_rank=whole_number("SLURM_LOCALID", environ.get("SLURM_LOCALID", "0")),
                     local_world_size=tasks_on_this_node(environ),
                     master_host=expand_hostlist(nodelist[1])[0],
                     job_id=environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID", "")))


def tasks_on_this_node(environ: Mapping[str, str]) -> int:
    """From the step's per-node task counts and this node's index in the step; 1 if unknown."""
    text = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not text:
        return 1
    counts = expand_counts(text)
    node = whole_number("SLURM_NODEID", environ.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else 1


def is_this_machine(host: str) -> bool:
    """Whether `host` names this machine: one of its addresses can be bound here."""
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, _, _, address in addresses:
        with socket.socket(family, kind) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def run_name(environ: Mapping[str, str]) -> str:
    """The run name every task of a job agrees on, and a requeued job (same id) finds again:
    slurm-<job id>, or slurm-<array job id>_<task id> (as squeue shows it); "" outside Slurm."""
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"slurm-{array_job}_{array_task}"
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    return f"slurm-{job}" if job else ""


def first_of(environ: Mapping[str, str], names: tuple[str, ...], default: str
             ) -> tuple[str, str]:
    for name in names:
        if environ.get(name):
            return name, environ[name]
    return names[0], default


def whole_number(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise UserError(f"{name}={value!r} is not a whole number (set by Slurm)") from None
    if number < 0:
        raise UserError(f"{name}={value!r} is negative (set by Slurm)")
    return number

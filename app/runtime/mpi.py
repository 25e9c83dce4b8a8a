"""An MPI launcher's view of this process (`mpirun`/`mpiexec` of Open MPI, MPICH or Intel MPI),
read from the variables it sets for every process it starts (OPEN_MPI, PMI below). No MPI
library is loaded: the ranks meet through torch.distributed like srun's tasks (slurm.py).

Where they meet: MASTER_ADDR and MASTER_PORT when given. Without MASTER_ADDR, loopback when
every rank runs on this machine; across machines nothing exists that every rank could agree on,
so the run stops with one line asking for it. Without MASTER_PORT, a port derived from the
job's name (Open MPI's PMIx namespace), so two jobs on one machine do not meet at one port;
else torchrun's default, 29500. devices.py decides which launcher's variables win.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Mapping

from app.runtime.errors import UserError
from app.runtime.slurm import PORT_BASE, PORT_SPAN

DEFAULT_PORT = 29500  # torchrun's
# rank, size, (local rank), (local size): Open MPI's names, then Hydra's PMI ones (PMI_LOCAL_*
# where a launcher names them so, as Cray's PALS does)
OPEN_MPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
            ("OMPI_COMM_WORLD_LOCAL_SIZE",))
PMI = ("PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
       ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"))


@dataclass(frozen=True)
class MpiRank:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # 0: the launcher does not say
    job: str  # a name every rank of the job shares ("" if none)
    # Read from PMI_*, which srun sets too (`srun --mpi=pmi2`), unlike OMPI_COMM_WORLD_*: only
    # such a rank may be srun's own task (app/runtime/devices.py).
    pmi: bool = False


def mpi_rank(environ: Mapping[str, str]) -> MpiRank | None:
    """This process as one rank of an MPI job of several, or None: not under an MPI launcher,
    or the only rank (then the driver starts its own workers: `mpirun -n 1 ... --gpus 8`)."""
    for rank, size, local_rank, local_size in (OPEN_MPI, PMI):
        if rank in environ and size in environ:
            world_size = number(environ, size)
            if world_size < 2:
                return None
            return MpiRank(number(environ, rank), world_size,
                           number(environ, *local_rank, default=0),
                           number(environ, *local_size, default=0),
                           environ.get("PMIX_NAMESPACE", ""), pmi=rank == PMI[0])
    return None


def meeting_point(task: MpiRank, environ: Mapping[str, str]) -> tuple[str, int]:
    """(host, port) where the ranks meet."""
    host = environ.get("MASTER_ADDR", "")
    if not host:
        if task.local_world_size != task.world_size:
            on = (f"{task.local_world_size} of them here" if task.local_world_size
                  else "the launcher does not say how many run here")
            raise UserError(f"under mpirun the {task.world_size} ranks run on more than one "
                            f"machine ({on}): set MASTER_ADDR to rank 0's host for every rank "
                            "(Open MPI: mpirun -x MASTER_ADDR=<host>; MPICH, Intel MPI: "
                            "mpiexec -genv MASTER_ADDR <host>)")
        host = "127.0.0.1"
    if environ.get("MASTER_PORT"):
        return host, number(environ, "MASTER_PORT")
    if task.job:
        return host, PORT_BASE + zlib.crc32(task.job.encode()) % PORT_SPAN
    return host, DEFAULT_PORT


def number(environ: Mapping[str, str], *names: str, default: int | None = None) -> int:
    """The first of `names` that is set, as a whole number (`default` if none is)."""
    for name in names:
        if environ.get(name):
            try:
                value = int(environ[name])
            except ValueError:
                value = -1
            if value < 0:
                raise UserError(f"{name}={environ[name]!r} is not a whole number (set by the "
                                "MPI launcher)")
            return value
    if default is None:
        raise UserError(f"{names[0]} is empty (set by the MPI launcher)")
    return default

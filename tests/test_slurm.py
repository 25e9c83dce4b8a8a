"""Slurm: the host-list parser, which launch variables win, and real srun-style tasks (two
processes started with the environment srun gives its tasks) training on loopback, stopped by
SIGUSR1 and continued with --resume auto."""

import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from app.catalog.storage import DatasetRoot
from app.catalog.tables import train_cls_list
from app.config import Config
from app.data.augment import TrainRecipe
from app.data.pillow_pipeline import build_loader
from app.data.sampler import ShardedBatches
from app.launch.run import check_launched, with_job_run_name
from app.runtime.liveness import descendants
from app.runtime import slurm
from app.runtime.devices import LaunchEnv
from app.runtime.errors import UserError
from app.runtime.interrupts import Action, AgreedRequests
from app.runtime.stop_signals import (PREEMPTED_EXIT_CODE, REPEAT_WINDOW_S, StopRequested,
                                     caught_for_a_call)
from app.runtime.slurm import expand_counts, expand_hostlist
from conftest import REPO, run_driver
from exact_runs import CATALOG, EXACT, assert_bit_identical, last, metric_rows


@pytest.mark.parametrize("text, hosts", [
    ("localhost", ["localhost"]),
    ("node1,node2", ["node1", "node2"]),
    ("tux[0-3]", ["tux0", "tux1", "tux2", "tux3"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding: the width grows
    ("gpu[001-004,010],cpu7", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "cpu7"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),  # padding kept past 099
    ("linux[1,3-4],lx7", ["linux1", "linux3", "linux4", "lx7"]),
    ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),  # several bracket groups
    ("rack[1-2]n[01-02].cluster", ["rack1n01.cluster", "rack1n02.cluster", "rack2n01.cluster",
                                   "rack2n02.cluster"]),
    ("x[5],y[7-8]", ["x5", "y7", "y8"]),
    ("ip-10-0-0-[1-2]", ["ip-10-0-0-1", "ip-10-0-0-2"]),
])
def test_host_lists_expand_as_slurm_documents(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, problem", [
    ("gpu[001-", "unbalanced"), ("gpu[3-1]", "backwards"), ("gpu[a-b]", "cannot read"),
    ("n1,,n2", "empty entry"), ("gpu]1[", "unbalanced"),
])
def test_broken_host_lists_are_one_line_errors(text, problem):
    with pytest.raises(UserError, match=problem):
        expand_hostlist(text)


def test_tasks_per_node_counts_expand():
    assert expand_counts("8(x2)") == [8, 8]
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]


def test_the_port_is_a_fixed_function_of_the_job_id():
    assert slurm.job_port("123456") == 10000 + 123456 % 20000 == 13456
    assert slurm.job_port("20000") == 10000
    assert all(10000 <= slurm.job_port(str(j)) < 30000 for j in (0, 1, 19999, 10 ** 9 + 7))


# What srun sets for task 1 of a 16-task step on two nodes (8 tasks each), in a job whose
# allocation is larger than the step.
SRUN_TASK_9 = {
    "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[001-004,010],cpu7",
    "SLURM_STEP_NODELIST": "gpu[003-004]", "SLURM_STEP_ID": "0", "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "16", "SLURM_NPROCS": "16",
    "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
    "SLURM_TASKS_PER_NODE": "8(x2)",
}


def test_srun_tasks_read_rank_world_and_master_from_slurm():
    assert LaunchEnv.from_environ(SRUN_TASK_9) == LaunchEnv(
        rank=9, world_size=16, local_rank=1, local_world_size=8, launcher="srun",
        init_method="tcp://gpu003:14242")  # the step's first node: task 0 runs there


def test_the_issues_minimal_srun_environment_is_enough():
    environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
               "SLURM_JOB_NODELIST": "gpu[001-004,010],cpu7", "SLURM_JOB_ID": "77"}
    assert LaunchEnv.from_environ(environ) == LaunchEnv(0, 2, 0, 1, "srun", "tcp://gpu001:10077")
    assert LaunchEnv.from_environ({**environ, "SLURM_NTASKS": "", "SLURM_NPROCS": "3"}
                                  ).world_size == 3  # the older name


def test_explicit_variables_win_over_slurms():
    # MASTER_ADDR/MASTER_PORT exported by the batch script, ranks from srun
    env = LaunchEnv.from_environ({**SRUN_TASK_9, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.launcher) == (9, 16, "srun")
    assert env.init_method == "tcp://10.1.2.3:29500"
    ipv6 = LaunchEnv.from_environ({**SRUN_TASK_9, "MASTER_ADDR": "fd00::1"})
    assert ipv6.init_method == "tcp://[fd00::1]:14242"
    # torchrun started by srun (one task per node): torchrun's variables are this process's
    torchrun = LaunchEnv.from_environ({**SRUN_TASK_9, "RANK": "3", "WORLD_SIZE": "32",
                                       "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "16"})
    assert torchrun == LaunchEnv(3, 32, 3, 16, "torchrun", "env://")


def test_a_batch_script_or_a_single_task_is_no_distributed_launch():
    # The batch script carries the job's SLURM_NTASKS and SLURM_PROCID=0, but no step id
    batch = {k: v for k, v in SRUN_TASK_9.items() if not k.startswith("SLURM_STEP")}
    assert LaunchEnv.from_environ({**batch, "SLURM_PROCID": "0", "ENVIRONMENT": "BATCH"}) is None
    # srun's tasks inherit ENVIRONMENT=BATCH from the script; their step id tells them apart
    assert LaunchEnv.from_environ({**SRUN_TASK_9, "ENVIRONMENT": "BATCH"}).rank == 9
    # `srun -n1 python bin/driver.py --gpus 8`: the driver starts its own workers
    single = {**SRUN_TASK_9, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    assert LaunchEnv.from_environ(single) is None
    # salloc's shell: job variables, no task
    assert LaunchEnv.from_environ({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "4"}) is None
    assert LaunchEnv.from_environ({}) is None


def test_bad_slurm_values_are_one_line_errors():
    with pytest.raises(UserError, match="SLURM_PROCID='x' is not a whole number"):
        LaunchEnv.from_environ({**SRUN_TASK_9, "SLURM_PROCID": "x"})
    with pytest.raises(UserError, match="no SLURM_JOB_NODELIST"):
        LaunchEnv.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"})


def test_run_names_come_from_the_job():
    assert slurm.run_name({"SLURM_JOB_ID": "4242"}) == "slurm-4242"
    assert slurm.run_name({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4240",
                           "SLURM_ARRAY_TASK_ID": "3"}) == "slurm-4240_3"
    assert slurm.run_name({}) == ""


def test_the_run_name_defaults_to_the_job_for_launched_groups_and_resume_auto():
    job = {"SLURM_JOB_ID": "4242"}
    config = Config()
    named = dataclasses.replace(config, run=dataclasses.replace(config.run, name="mine"))
    resuming = dataclasses.replace(config, run=dataclasses.replace(config.run, resume="auto"))
    task = LaunchEnv.from_environ(SRUN_TASK_9)
    assert with_job_run_name(config, task, SRUN_TASK_9).run.name == "slurm-4242"
    assert with_job_run_name(named, task, SRUN_TASK_9).run.name == "mine"  # --run-name wins
    assert with_job_run_name(resuming, None, job).run.name == "slurm-4242"  # sbatch --requeue
    # a plain run inside an allocation keeps a name of its own (two runs, two folders)
    assert with_job_run_name(config, None, job).run.name == ""
    assert with_job_run_name(resuming, None, {}).run.name == ""  # outside Slurm: as before


def test_slurm_restarts_a_job_the_driver_does_not():
    config = Config()
    restarting = dataclasses.replace(config, run=dataclasses.replace(
        config.run, name="r50", max_restarts=3))
    with pytest.raises(UserError, match="under srun, Slurm starts the job again: submit it "
                                        "with sbatch --requeue"):
        check_launched(restarting, LaunchEnv.from_environ(SRUN_TASK_9))


def test_task_0_must_run_where_the_tasks_meet():
    assert slurm.is_this_machine("localhost") and slurm.is_this_machine(socket.gethostname())
    assert not slurm.is_this_machine("192.0.2.1")  # TEST-NET-1: never this machine's
    assert not slurm.is_this_machine("no-such-node.invalid")


def test_each_task_takes_its_own_gpu_bound_or_not():
    task = LaunchEnv(rank=9, world_size=16, local_rank=3, local_world_size=8, launcher="srun")
    assert task.device("cpu", 8, bound=False) == "cpu"
    assert task.device("cuda:0", 0, bound=False) == "cpu"
    assert task.device("cuda:0", 8, bound=False) == "cuda:3"  # the node's GPUs all visible
    assert task.device("cuda:0", 1, bound=True) == "cuda:0"  # --gpus-per-task 1
    assert task.device("cuda:0", 1, bound=False) == "cuda:0"  # --gpu-bind: its one GPU
    assert task.device("cuda:0", 2, bound=True) == "cuda:0"  # --gpus-per-task 2
    with pytest.raises(UserError, match="local rank 3 sees only 2 GPUs"):
        task.device("cuda:0", 2, bound=False)


def test_a_launched_process_refuses_to_start_workers_of_its_own():
    task = LaunchEnv(rank=0, world_size=16, local_rank=0, launcher="srun")
    task.check_one_device_each(0, [])
    task.check_one_device_each(0, ["cpu"])
    with pytest.raises(UserError, match="--gpus 8 conflicts with srun, which started this "
                                        "process as one of 16 workers"):
        task.check_one_device_each(8, [])
    with pytest.raises(UserError, match="--devices cpu,cpu conflicts with torchrun"):
        LaunchEnv(0, 2, 0).check_one_device_each(0, ["cpu", "cpu"])


def test_a_stop_signal_delivered_twice_is_one_request():
    """At preemption slurmstepd signals every task, and srun (or torchrun) forwards the
    signal it got too: the repeat must not turn the save-and-stop into a stop at once."""
    with caught_for_a_call() as signals:
        requests = AgreedRequests(sync=None, world_size=1, interval_minutes=0, signals=signals)
        assert requests.checkpointed(0, 0) == Action()  # training begun: a request waits
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert requests.poll(0, 5) == Action(stop=True) and signals.requests == 1
        time.sleep(REPEAT_WINDOW_S + 0.1)
        with pytest.raises(StopRequested):  # a later one: a person who means it
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.5)


def test_loader_processes_outlive_the_signals_slurm_sends_to_the_whole_step(tiny_sample):
    """slurmstepd signals every process of a step: a loader process killed by SIGUSR1 or
    SIGTERM would fail its worker's next batch before the worker could save."""
    root = DatasetRoot("t", str(tiny_sample))
    frame = train_cls_list(root)
    batches = ShardedBatches(len(frame), 32, seed=0)
    before = set(descendants(os.getpid()))
    loader = iter(build_loader(root, frame, TrainRecipe(24), batches, workers=1))
    images = len(next(loader))
    (pid,) = set(descendants(os.getpid())) - before
    for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        os.kill(pid, signum)
    images += sum(len(batch) for batch in loader)  # every later batch still arrives
    assert images == len(frame)


# --- two srun tasks on loopback --------------------------------------------------------------

def free_job_id() -> str:
    """A job id whose derived port (10000 + id % 20000) is free on this machine now."""
    for _ in range(100):
        job_id = random.randrange(10 ** 5, 10 ** 6)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", slurm.job_port(str(job_id))))
            except OSError:
                continue
        return str(job_id)
    raise AssertionError("no free port in 10000-29999")


def srun_environ(job_id: str, rank: int, tasks: int = 2) -> dict[str, str]:
    """What srun gives task `rank` of `srun --ntasks 2` on one node (no MASTER_*, no RANK)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                        "MASTER_ADDR", "MASTER_PORT")}
    return {**base, "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
            "SLURM_NTASKS": str(tasks), "SLURM_NPROCS": str(tasks),
            "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_TASKS_PER_NODE": str(tasks),
            "SLURM_STEP_TASKS_PER_NODE": str(tasks), "SLURM_JOB_NODELIST": "localhost",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_NNODES": "1"}


class Step:
    """The tasks of one srun step: every task runs bin/driver.py with the same flags."""

    def __init__(self, cwd, job_id: str, *flags: str, tasks: int = 2):
        self.logs = [cwd / f"task{rank}.err" for rank in range(tasks)]
        self.tasks = [subprocess.Popen(
            [sys.executable, str(REPO / "bin" / "driver.py"), *flags], cwd=cwd,
            env=srun_environ(job_id, rank, tasks), stdout=subprocess.DEVNULL,
            stderr=open(log, "w")) for rank, log in enumerate(self.logs)]

    def stderr(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [task.wait(timeout=max(1.0, deadline - time.monotonic()))
                    for task in self.tasks]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"tasks still running: {self.stderr(0)[-2000:]}"
                                 f"{self.stderr(1)[-2000:]}") from None

    def kill(self) -> None:
        for task in self.tasks:
            if task.poll() is None:
                task.kill()
                task.wait()


SRUN_FLAGS = (*CATALOG, *EXACT, "-b", "4", "--device", "cpu", "--sync", "allreduce")


def test_srun_tasks_train_like_the_drivers_own_workers_and_a_requeued_job_resumes(
        straight, tmp_path):
    """Two srun tasks, the run named by the job: the time-limit warning reaches one task, both
    tasks save at the same step and exit 75; the job, requeued under the same id, continues
    with --resume auto and ends exactly where the driver's own two workers end, never stopped,
    each epoch logged once (by task 0). (Loader processes: the test above.)"""
    job_id = free_job_id()
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    flags = (*SRUN_FLAGS, "--resume", "auto")  # the same command in the job and its requeue
    step = Step(tmp_path, job_id, *flags)
    try:
        deadline = time.monotonic() + 180
        while not any(r["step"] >= 5 for r in metric_rows(run_dir)):
            assert all(t.poll() is None for t in step.tasks), step.stderr(0) + step.stderr(1)
            assert time.monotonic() < deadline, "no training step logged"
            time.sleep(0.05)
        step.tasks[1].send_signal(signal.SIGUSR1)
        codes = step.wait(timeout=120)
    finally:
        step.kill()
    assert codes == [PREEMPTED_EXIT_CODE] * 2, step.stderr(0)[-3000:] + step.stderr(1)[-3000:]
    assert f"--resume auto --run-name slurm-{job_id}" in step.stderr(0)
    stopped_stderr = step.stderr(0) + step.stderr(1)
    cut = last(run_dir)
    assert cut["epoch"] < 2 and 0 < cut["epoch_step"] < 20  # stopped inside an epoch
    assert len(cut["replicas"]) == 2

    requeued = Step(tmp_path, job_id, *flags)
    assert requeued.wait(timeout=240) == [0, 0], requeued.stderr(0)[-3000:]
    assert_bit_identical(straight("2 workers allreduce"), last(run_dir))
    rows = metric_rows(run_dir)
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps[-1] == 40 and steps.count(cut["step"] + 1) == 1  # went on, nothing repeated
    assert [r["epoch"] for r in rows if "val/top1" in r] == [1, 2]
    assert "Traceback" not in stopped_stderr + requeued.stderr(0) + requeued.stderr(1)


def test_gpus_inside_an_srun_task_is_a_one_line_error(tmp_path):
    result = run_driver(*CATALOG, "--gpus", "2", cwd=tmp_path, env=srun_environ("31337", 0))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --gpus 2 conflicts with srun, which started this process as one of 2 workers "
        "with one device each; drop --gpus 2 and ask srun for them: --ntasks-per-node N "
        "--gpus-per-task 1"]
    assert not (tmp_path / "runs").exists()


def test_task_0_on_another_host_than_the_first_node_is_a_one_line_error(tmp_path):
    """Rather than every task waiting for --sync-timeout at an address nobody serves."""
    environ = {**srun_environ("31337", 0), "SLURM_STEP_NODELIST": "gpu[001-002]",
               "SLURM_JOB_NODELIST": "gpu[001-002]"}
    result = run_driver(*CATALOG, cwd=tmp_path, env=environ)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: task 0 runs on {socket.gethostname()}, but the tasks meet at gpu001 (the "
        "first node of the step): set MASTER_ADDR to task 0's host"]
    # MASTER_ADDR wins over the node list: past that check, the next one answers
    environ["MASTER_ADDR"] = "localhost"
    result = run_driver(*CATALOG, "--gpus", "2", cwd=tmp_path, env=environ)
    assert result.returncode == 2 and "--gpus 2 conflicts with srun" in result.stderr

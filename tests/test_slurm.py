"""Slurm: the host-list parser, which launch variables win, and real srun-style tasks (two
processes started with the environment srun gives its tasks) training on loopback, stopped by
SIGUSR1 and continued with --resume auto."""

import pytest

from app import slurm
from app.devices import LaunchEnv
from app.errors import UserError
from app.slurm import expand_counts, expand_hostlist


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

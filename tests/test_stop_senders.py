"""One way to stop, whoever sends the signal: the driver alone (tests/test_remote_output.py),
every process of the run's group (Slurm's preemption of a step, systemd stopping a spot machine,
`kill -- -PGID`), Ctrl-C's whole foreground group, SIGUSR1 to every process, torchrun's agent
passing its SIGTERM on to the ranks. Each time the run saves once, its bucket's last.pt names
that checkpoint, and a fresh machine (staging wiped) resumes it from the bucket and ends it,
each epoch evaluated once and each step logged once: one worker at the same global batch, or,
after a SIGTERM to every process, the same workers, ending bit-identical to a run never
stopped (what the workers, the server and the loaders saved when each got the signal)."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from app.catalog.remote_run import staging_folder
from app.parallel.plans import free_port
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE
from conftest import REPO, run_driver
from exact_runs import CATALOG, EXACT, SPLITS, assert_bit_identical, driver
from test_remote_output import as_checkpoint, bucket_files, new_bucket, wait_for_step


def torchrun(*args: str) -> list[str]:
    """Two ranks on this machine, as a user starts them; the agent is the process signalled."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
            "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            str(REPO / "bin" / "driver.py"), *args, "-b", "4", "--device", "cpu"]


# sender: (how the run starts, the signal, sent to the group (True) or the first process
# alone, the split that resumes it)
SENDERS = {
    "SIGTERM to every process, ps": ("2 workers ps", signal.SIGTERM, True, "2 workers ps"),
    "SIGTERM to every process, allreduce": ("2 workers allreduce", signal.SIGTERM, True,
                                            "2 workers allreduce"),
    "Ctrl-C to the foreground group, ps": ("2 workers ps", signal.SIGINT, True, "1 worker"),
    "SIGUSR1 to every process, allreduce": ("2 workers allreduce", signal.SIGUSR1, True,
                                            "1 worker"),
    "torchrun's agent passes SIGTERM on": ("torchrun", signal.SIGTERM, False, "1 worker")}


@pytest.mark.parametrize("sender", SENDERS)
def test_any_sender_of_a_stop_saves_into_the_bucket_and_a_fresh_machine_ends_the_run_from_it(
        s3_server, tmp_path, straight, sender):
    split, stop, to_group, resume_split = SENDERS[sender]
    bucket = new_bucket(s3_server, f"stop-{list(SENDERS).index(sender)}")
    url, env = f"s3://{bucket}/exp", {"AWS_ENDPOINT_URL": s3_server.endpoint}
    common = (*CATALOG, *EXACT, "--run-name", "g", "--output-dir", url, "--stop-timeout", "30")
    command = torchrun(*common) if split == "torchrun" else driver(*common, *SPLITS[split])
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, **env},
                               start_new_session=True)  # a job step's or a service's group
    wait_for_step(process, staging_folder(url) / "g", 5)
    if to_group:
        os.killpg(process.pid, stop)
    else:
        os.kill(process.pid, stop)
    code, stderr = process.wait(timeout=90), process.stderr.read()
    if split != "torchrun":  # the ranks take the agent's signal each; its exit is torchrun's
        assert f"{stop.name}: saving a checkpoint of the step under way" in stderr, stderr
        assert code == PREEMPTED_EXIT_CODE, stderr
    cut = as_checkpoint(bucket_files(s3_server, bucket)["exp/g/checkpoints/last.pt"])
    assert 5 <= cut["step"] < 20 and len(cut["replicas"]) == 2
    assert f"after step {cut['step']} " in stderr  # the stop's checkpoint is the bucket's
    assert "--resume auto --run-name g" in stderr

    shutil.rmtree(staging_folder(url))  # the requeued job runs on a machine that never saw it
    resumed = run_driver(*common, *SPLITS[resume_split], "--resume", "auto", cwd=tmp_path,
                         env=env)
    assert resumed.returncode == 0, resumed.stderr
    files = bucket_files(s3_server, bucket)
    end = as_checkpoint(files["exp/g/checkpoints/last.pt"])
    assert end["step"] == 40
    if resume_split == split:
        assert_bit_identical(straight(split), end)
    rows = [json.loads(line) for line in files["exp/g/metrics.jsonl"].decode().splitlines()]
    assert [r["epoch"] for r in rows if "val/top1" in r] == [1, 2]
    steps = [r["step"] for r in rows if "val/top1" not in r and "step" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 40

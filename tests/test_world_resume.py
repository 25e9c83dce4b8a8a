"""Resuming on another number of workers (issue 32): the rule that keeps the global batch, the
LR schedule across a new global batch at an epoch's end, and real runs stopped on 2 workers
and resumed on 4 (a requeued driver) and on 1 (an elastic torchrun job that lost a node) that
train every image of every epoch once and end where an uninterrupted run does."""

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from app.config.sources import parse_config
from app.launch.run import prepare_job
from app.loggers import NullLogger
from app.parallel.sync import LocalSync
from app.parallel.plans import free_port
from app.runtime.devices import WorkerEnv
from app.runtime.errors import UserError
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE
from app.training import checkpoint, run_state
from app.training.batch_layout import (BatchLayout, Saved, resumed_job, resumed_layout,
                                       split_per_worker)
from app.training.sample_log import records, trained_samples
from app.training.trainer import Trainer, train_worker
from conftest import REPO, run_driver
from test_parallel import relative_difference
from exact_runs import CATALOG, last, metric_rows, stop_with_sigterm_after
from training import train_in_process


def saved(world_size, per_worker, accumulation=1, epoch_step=5, requested=None):
    layout = BatchLayout(world_size, per_worker, accumulation)
    return Saved(layout, requested or (per_worker, accumulation), epoch=0, epoch_step=epoch_step)


def test_fewer_workers_keep_the_global_batch_by_accumulating():
    resumed = resumed_layout(saved(8, 32), (32, 1), world_size=4)  # 8 GPUs requeued on 4
    assert resumed.layout == BatchLayout(4, 32, 2) and resumed.layout.global_batch == 256
    assert resumed.note == ("resumed on 4 workers (saved by 8): per-worker batch 32, "
                            "accumulation 2, same global batch and sample order")
    assert resumed_layout(saved(2, 8), (8, 1), 1).layout == BatchLayout(1, 8, 2)


def test_more_workers_take_smaller_batches():
    assert resumed_layout(saved(2, 8), (8, 1), 4).layout == BatchLayout(4, 4, 1)
    # accumulated on 1 worker, spread over 4: the micro-batches stop being needed
    assert resumed_layout(saved(1, 8, 4), (8, 4), 4).layout == BatchLayout(4, 8, 1)
    # the user's -b bounds a worker's micro-batch, whatever the layout saved last
    chained = saved(4, 4, requested=(8, 1))  # 2 x 8 resumed on 4 earlier
    assert resumed_layout(chained, (8, 1), 1).layout == BatchLayout(1, 8, 2)


def test_per_worker_images_split_into_the_fewest_equal_micro_batches():
    assert split_per_worker(64, 32) == (32, 2)
    assert split_per_worker(24, 16) == (12, 2)
    assert split_per_worker(30, 8) == (6, 5)
    assert split_per_worker(7, 4) == (1, 7)  # a prime: one image at a time, still exact
    assert split_per_worker(4, 8) == (4, 1)


def test_the_same_global_batch_split_anew_is_taken_as_given():
    same = resumed_layout(saved(2, 8), (16, 1), 1)  # -b 16 on one worker: 16 images a step
    assert same.layout == BatchLayout(1, 16, 1) and "accumulation 1" in same.note
    assert resumed_layout(saved(2, 8), (8, 1), 2).note == ""  # a plain resume says nothing


def refusal(*args, **options) -> str:
    with pytest.raises(UserError) as refused:
        resumed_layout(*args, **options)
    return str(refused.value)


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_with_the_way_out():
    """The override that changes the global batch is offered only where it is allowed: from a
    checkpoint written at an epoch's end."""
    assert refusal(saved(4, 8, epoch_step=0), (8, 1), 3) == (
        "cannot keep the checkpoint's global batch of 32 images on 3 workers (32 is not a "
        "multiple of 3): resume on 2 or 4 workers, or give --no-keep-global-batch to train on "
        "with 3 x 8 x 1 = 24 images from epoch 1 on")
    assert refusal(saved(4, 8), (8, 1), 3) == (
        "cannot keep the checkpoint's global batch of 32 images on 3 workers (32 is not a "
        "multiple of 3): resume on 2 or 4 workers (the checkpoint is 5 steps into epoch 1; "
        "changing the global batch needs a checkpoint written at an epoch's end)")


def test_a_new_global_batch_is_refused_mid_epoch_and_allowed_at_an_epochs_end():
    assert refusal(saved(2, 8), (4, 1), 2) == (
        "-b 4 --accum-steps 1 on 2 workers is a global batch of 8 images, but the checkpoint "
        "is 5 steps into epoch 1 with 16: the global batch can change only at an epoch's end; "
        "give -b 8 --accum-steps 1, or resume from a checkpoint written at an epoch's end")
    at_end = resumed_layout(saved(2, 8, epoch_step=0), (8, 1), 3, keep=False)
    assert at_end.layout == BatchLayout(3, 8, 1)
    assert at_end.note.startswith("global batch 16 -> 3 x 8 x 1 = 24 images from epoch 1 on: "
                                  "the LR scales by 24/16")


def test_a_refusal_names_only_changes_that_make_the_resume_work():
    """Each way out, taken, is accepted: never the flags the user just gave."""
    own_flags = refusal(saved(2, 8), (8, 1), 4, keep=False)  # the run's own -b, on 4 workers
    assert own_flags.startswith("--no-keep-global-batch with -b 8 --accum-steps 1 on 4 workers "
                                "is a global batch of 32 images")
    assert own_flags.endswith("epoch's end; drop --no-keep-global-batch, or resume from a "
                              "checkpoint written at an epoch's end")
    assert resumed_layout(saved(2, 8), (8, 1), 4).layout == BatchLayout(4, 4, 1)  # dropped
    # 16 images on 3 workers cannot stay 16: the way out names the world sizes that keep it
    everything = refusal(saved(2, 8), (4, 1), 3, keep=False)
    assert everything.endswith("give -b 8 --accum-steps 1 and drop --no-keep-global-batch and "
                               "resume on 2 or 4 workers, or resume from a checkpoint written "
                               "at an epoch's end")
    for workers in (2, 4):
        assert resumed_layout(saved(2, 8), (8, 1), workers).layout.global_batch == 16


def test_checkpoints_without_the_record_read_their_layout_from_config_and_replicas():
    old = {"epoch": 1, "epoch_step": 3, "replicas": [b"", b""],
           "config": {"train": {"batch_size": 8, "accum_steps": 2}}}
    assert Saved.of(old) == Saved(BatchLayout(2, 8, 2), (8, 2), 1, 3)
    assert Saved.of(old).image_offset == 3 * 32


def test_a_new_global_batch_at_an_epochs_end_scales_the_lr_and_keeps_the_schedules_epoch(
        tmp_path):
    """One epoch with 160 images in steps of 8 (20), then resumed with -b 16 (10 steps an
    epoch): the schedule's step 20 becomes step 10, the same epoch; the LR doubles."""
    flags = ("--classes", "5", "--epochs", "3", "--warmup-epochs", "0", "-p", "5")
    first = train_in_process(tmp_path, *flags, "-b", "8", "--epochs", "1", "--run-name", "r")
    train_worker(first, WorkerEnv(), LocalSync(), NullLogger())
    path = tmp_path / "r" / "checkpoints" / "last.pt"
    before = Trainer(train_in_process(tmp_path, *flags, "-b", "8", "--resume", str(path)),
                     WorkerEnv(), LocalSync())
    after = Trainer(train_in_process(tmp_path, *flags, "-b", "16", "--no-keep-global-batch",
                                     "--resume", str(path)), WorkerEnv(), LocalSync())
    for trainer in (before, after):
        trainer.load_state_dict(run_state.load(trainer.job, WorkerEnv()))
        trainer.close()
    assert checkpoint.load(path)["scheduler"]["last_epoch"] == 20
    assert before.scheduler.last_epoch == 20 and after.scheduler.last_epoch == 10
    lr_before = before.optimizer.param_groups[0]["lr"]
    assert after.optimizer.param_groups[0]["lr"] == pytest.approx(2 * lr_before, rel=1e-12)
    assert (before.position.epoch, before.position.epoch_step) == (1, 0)


def test_replicas_resumed_on_another_number_start_from_the_mean_of_the_saved_statistics(
        tmp_path):
    """A checkpoint written mid-epoch by 2 replicas whose BatchNorm running statistics differ
    (averaged only at an epoch's end), resumed on 1 and on 4 workers: every replica starts
    from their mean, not from replica 0's; on 2 each takes its own back."""
    flags = ("--classes", "5", "--run-name", "r")
    job = train_in_process(tmp_path, *flags, "-b", "4")
    trainer = Trainer(job, WorkerEnv(), LocalSync())
    state = {**trainer.state_dict(), "epoch_step": 3, "step": 3}
    replica = state.pop("replica")

    def shifted(by: float) -> bytes:  # a replica entry as run_state.save gathers it
        data = io.BytesIO()
        torch.save({**replica, "buffers": {name: (values + by) * (1 + by)
                                           for name, values in replica["buffers"].items()}},
                   data)
        return data.getvalue()
    path = tmp_path / "r" / "two.pt"
    checkpoint.save(path, {**state, "replicas": [shifted(1), shifted(3)],
                           "config": job.config.to_dict(), "batch": {
                               "world_size": 2, "per_worker": 4, "accumulation": 1,
                               "global_batch": 8, "requested": [4, 1]}})
    mean = {name: ((values + 1) * 2 + (values + 3) * 4) / 2
            for name, values in replica["buffers"].items()}
    assert any("running_var" in name for name in mean) and len(mean) > 10  # BatchNorm's

    def resumed(world_size: int, rank: int, *batch: str) -> dict:
        again = train_in_process(tmp_path, *flags, *batch, "--resume", str(path))
        return run_state.load(again, WorkerEnv(rank=rank, world_size=world_size))
    for world_size, rank, batch in ((1, 0, ("-b", "4", "--accum-steps", "2")),
                                    (4, 0, ("-b", "2")), (4, 3, ("-b", "2"))):
        loaded = resumed(world_size, rank, *batch)
        assert loaded["epoch_step"] == 3  # the same 24 images into the epoch
        for name, values in mean.items():
            assert torch.allclose(loaded["replica"]["buffers"][name], values), name
    own = resumed(2, 1, "-b", "4")["replica"]["buffers"]
    assert all(torch.equal(own[name], (values + 3) * 4)
               for name, values in replica["buffers"].items())
    # and the mean is what the replica's model holds once loaded
    single = Trainer(train_in_process(tmp_path, *flags, "-b", "4", "--accum-steps", "2",
                                      "--resume", str(path)), WorkerEnv(), LocalSync())
    single.load_state_dict(resumed(1, 0, "-b", "4", "--accum-steps", "2"))
    buffers = dict(single.model.named_buffers())
    assert all(torch.allclose(buffers[name], values) for name, values in mean.items())
    trainer.close()
    single.close()


def test_the_sample_record_keeps_what_the_last_start_trained_from_its_place_on(tmp_path):
    """32 images, global batch 4. A 2-worker run (start 1) trained offsets 0-12 and was killed;
    its restart on 1 worker (start 2) went on from its last checkpoint, offset 8, to the end.
    Clocks say nothing: rank 1's lines carry later times than the restart's."""
    folder = tmp_path / "samples"
    folder.mkdir()

    def lines(*records):
        return "".join(json.dumps(r) + "\n" for r in records)

    def batch(start, offset, samples):
        return {"time": 99.0, "start": start, "epoch": 1, "offset": offset,
                "samples": list(samples)}

    def start(number, offset):
        return {"event": "start", "start": number, "epoch": 1, "offset": offset, "time": 1.0}

    (folder / "rank-0.jsonl").write_text(lines(
        start(1, 0), *(batch(1, o, (o, o + 1)) for o in (0, 4, 8, 12)),
        start(2, 8), *(batch(2, o, range(o, o + 4)) for o in range(8, 32, 4))))
    (folder / "rank-1.jsonl").write_text(lines(
        start(1, 0), *(batch(1, o, (o + 2, o + 3)) for o in (0, 4, 8, 12))))
    assert sorted(trained_samples(tmp_path)[1]) == list(range(32))


# --- real runs: 2 workers stopped mid-epoch, resumed on 4 and (torchrun) on 1 -------------

# GroupNorm (no BatchNorm: its batch statistics depend on the per-worker batch), float64, no
# augmentation randomness that depends on the split: 160 images, global batch 8, one epoch of
# 20 steps, stopped after step 5 or so; every worker records what it trained on.
RUN = (*CATALOG, "-a", "test_resnet", "--norm", "group", "--dtype", "float64", "--amp", "off",
       "--classes", "5", "--image-size", "32", "-j", "0", "--lr", "0.2", "--warmup-epochs",
       "0.5", "--epochs", "1", "-p", "1", "--log-samples", "--run-name", "cut")
DEVICES = {1: ("--device", "cpu"), 2: ("--devices", "cpu,cpu"),
           3: ("--devices", "cpu,cpu,cpu"), 4: ("--devices", "cpu,cpu,cpu,cpu")}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A 2-worker run (-b 4, the parameter server) stopped by SIGTERM mid-epoch."""
    cwd = tmp_path_factory.mktemp("stopped")
    code, stderr = stop_with_sigterm_after(cwd, (*RUN, "-b", "4", *DEVICES[2]), step=5)
    assert code == PREEMPTED_EXIT_CODE, stderr
    cut = last(cwd / "runs" / "cut")
    assert 0 < cut["epoch_step"] < 20 and cut["epoch"] == 0
    assert cut["batch"] == {"world_size": 2, "per_worker": 4, "accumulation": 1,
                            "global_batch": 8, "requested": [4, 1]}
    return cwd / "runs" / "cut"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One worker with the rule's layout for it (-b 4, 2 micro-batches): an uninterrupted run
    of the same global batch, where every resumed run must end."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    result = run_driver(*RUN, "-b", "4", "--accum-steps", "2", *DEVICES[1], cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return last(cwd / "runs" / "cut")


def resumed_on(stopped, tmp_path, workers: int):
    run_dir = tmp_path / "runs" / "cut"
    shutil.copytree(stopped, run_dir)
    return run_driver(*RUN, "-b", "4", *DEVICES[workers], "--resume", "auto", cwd=tmp_path), \
        run_dir


def assert_each_image_trained_once(run_dir, cut: dict) -> None:
    """The run's raw record (every line of samples/, nothing left out) of an epoch stopped at
    the checkpoint `cut` and resumed once from it: the second start went on at the
    checkpoint's image offset, the first had trained nothing past it (a SIGTERM saves at the
    step it stops), and together their batches hold every image of the epoch once. A resume
    that began before the checkpoint's place would show those images twice."""
    lines = records(run_dir)
    offset = cut["epoch_step"] * cut["batch"]["global_batch"]
    assert {(r["start"], r["offset"]) for r in lines if r.get("event")} == {(1, 0), (2, offset)}
    batches = [r for r in lines if not r.get("event")]
    assert max(r["offset"] for r in batches if r["start"] == 1) < offset
    assert min(r["offset"] for r in batches if r["start"] == 2) == offset
    assert sorted(row for r in batches for row in r["samples"]) == list(range(160))
    assert sorted(trained_samples(run_dir)[1]) == list(range(160))  # the app's reading agrees


def assert_ends_as_uninterrupted(run_dir, uninterrupted: dict, workers: int, at_stop: dict
                                 ) -> None:
    done = last(run_dir)
    assert (done["epoch"], done["step"]) == (1, 20)
    assert done["batch"]["world_size"] == workers and done["batch"]["requested"] == [4, 1]
    assert relative_difference(uninterrupted["model"], done["model"]) < 1e-9
    assert relative_difference(at_stop["model"], done["model"]) > 1e-3  # sanity: it trained on


def test_stopped_on_2_workers_resumed_on_4_trains_every_image_once(stopped, uninterrupted,
                                                                   tmp_path):
    """A requeued job: a new driver with --resume auto on 4 workers (2 images each). Its end
    equals the 1-worker uninterrupted run's: the same global batches, and N x b == 1 x N*b
    (test_parallel.py) within the same tolerance."""
    result, run_dir = resumed_on(stopped, tmp_path, 4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("resumed on 4 workers (saved by 2): per-worker batch 2, accumulation 1, same "
            "global batch and sample order") in result.stderr
    cut = checkpoint.load(stopped / "checkpoints" / "last.pt")
    assert_each_image_trained_once(run_dir, cut)
    assert_ends_as_uninterrupted(run_dir, uninterrupted, 4, cut)


# Two torchrun agents on this machine, one node of one worker each, in one elastic job of 1 to 2
# nodes. The rendezvous is tuned for a test (the defaults: 15 s and 30 s): a node whose
# heartbeat stops is dropped after 3 s (1 s x 3), and a round closes 3 s after it has the
# fewest nodes allowed. The store's host is named so that the departing agent is not it, and
# the other agent starts first: it waits for the store and joins as soon as it is up, so the
# first round has both nodes before its 3 s last call ends.
ELASTIC = ("-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-id", "shrink")
RENDEZVOUS = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"


def elastic_agent(cwd, port: int, hosts_store: bool, name: str) -> subprocess.Popen:
    """One torchrun agent around the driver (2 x -b 4 all-reduce); its output in cwd/name."""
    command = [sys.executable, *ELASTIC, "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-conf", f"is_host={int(hosts_store)},{RENDEZVOUS}",
               str(REPO / "bin" / "driver.py"), *RUN, "-b", "4", "--device", "cpu",
               "--sync", "allreduce", "--resume", "auto"]
    with open(cwd / name, "w") as output:
        return subprocess.Popen(command, cwd=cwd, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)


@pytest.mark.slow
def test_an_elastic_torchrun_job_losing_a_node_goes_on_with_one_worker_and_the_same_samples(
        uninterrupted, tmp_path):
    """torchrun --nnodes 1:2 --max-restarts 1: one agent's node is preempted (SIGTERM), both
    workers save at one step mid-epoch, and the agent that is left meets alone in the next
    rendezvous round and starts its worker again with WORLD_SIZE 1 and --resume auto."""
    port = free_port()
    leaving = elastic_agent(tmp_path, port, False, "leaving.log")
    staying = elastic_agent(tmp_path, port, True, "staying.log")
    run_dir = tmp_path / "runs" / "cut"
    try:
        deadline = time.monotonic() + 120
        while not any(r["step"] >= 5 for r in metric_rows(run_dir) if "step" in r):
            assert staying.poll() is None and leaving.poll() is None, \
                (tmp_path / "staying.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        leaving.send_signal(signal.SIGTERM)
        leaving.wait(timeout=60)
        code = staying.wait(timeout=180)
    finally:
        for agent in (leaving, staying):
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    log = (tmp_path / "staying.log").read_text()
    assert code == 0, log[-3000:]
    assert ("resumed on 1 worker (saved by 2): per-worker batch 4, accumulation 2, same global "
            "batch and sample order") in log
    # The first round had both nodes, the second the one left (the primary's line per start).
    starts = (run_dir / "samples" / "starts.jsonl").read_text().splitlines()
    assert [json.loads(line)["world_size"] for line in starts] == [2, 1], log[-3000:]
    (cut_path,) = [p for p in (run_dir / "checkpoints").glob("step-*.pt")
                   if p.name != "step-000000020.pt"]
    cut = checkpoint.load(cut_path)  # where the SIGTERM stopped both workers
    assert 0 < cut["epoch_step"] < 20 and cut["batch"]["world_size"] == 2
    assert_each_image_trained_once(run_dir, cut)
    assert_ends_as_uninterrupted(run_dir, uninterrupted, 1, cut)


def test_a_world_size_that_cannot_keep_the_global_batch_is_one_line_before_anything_starts(
        stopped, tmp_path):
    result, run_dir = resumed_on(stopped, tmp_path, 3)
    cut = last(stopped)["epoch_step"]
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: cannot keep the checkpoint's global batch of 8 images on 3 workers (8 is not a "
        f"multiple of 3): resume on 2 or 4 workers (the checkpoint is {cut} steps into epoch 1; "
        "changing the global batch needs a checkpoint written at an epoch's end)")
    assert "Traceback" not in result.stderr and "started" not in result.stderr


def test_an_evaluation_of_the_checkpoint_takes_any_number_of_workers(stopped):
    """-e trains no step: 3 workers evaluate the checkpoint that 3 workers cannot train on."""
    def job(*flags):
        config, _ = parse_config([*RUN, "-b", "4", "--output-dir", str(stopped.parent),
                                  "--resume", "auto", *flags])
        return prepare_job(config)
    with pytest.raises(UserError, match="cannot keep the checkpoint's global batch of 8"):
        resumed_job(job(), 3)
    evaluation = job("-e")
    assert resumed_job(evaluation, 3) is evaluation


"""Gradient accumulation (--accum-steps K): K micro-batches of b images compute the step that
one batch of K x b would, with one gradient exchange per optimizer step, in both sync modes."""

import queue
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from app.config.sources import parse_config
from app.launch.run import prepare_job, write_run_folder
from app.loggers import NullLogger
from app.parallel.sync import LocalSync
from app.parallel.allreduce import AllReduceSync
from app.parallel.plans import free_port
from app.parallel.ps_server import ServerLinks, run_server
from app.parallel.ps_worker import ParameterServerSync
from app.parallel.watch import Watch
from app.runtime.devices import WorkerEnv
from app.runtime.interrupts import Action, NoRequests
from app.training.accumulation import Accumulation
from app.training.trainer import Finished, Stopped, train_worker
from conftest import run_driver
from test_parallel import CATALOG, EXACT, relative_difference, weights
from test_train import Recorder as MetricsRecorder, train_in_process
from test_ps_protocol import Recorder, RecordingServer, RecordingWorker

# Per worker, per optimizer step: the images of each micro-batch. Short and empty ones
# included: worker 1's last micro-batch of step 1 is empty (DDP cannot run its backward).
MICRO_BATCHES = {0: [(4, 4, 2), (3, 1)], 1: [(4, 4, 2), (2, 0)]}


def test_pipeline_batches_group_into_optimizer_steps():
    grouping = Accumulation(micro_batches=3, batches_per_epoch=29)
    assert grouping.steps_per_epoch == 10
    marked = list(grouping.micro_batches_of(range(29), epoch_step=0))
    assert [micro for _, micro, _ in marked[:4]] == [0, 1, 2, 0]
    # every third batch ends a step, and the epoch's last (a step of 2 micro-batches)
    assert [batch for batch, _, last in marked if last] == [2, 5, 8, 11, 14, 17, 20, 23, 26, 28]
    # a resumed epoch restarts its pipeline at the step's first batch, marked alike
    assert grouping.first_batch(4) == 12
    assert list(grouping.micro_batches_of(range(12, 29), epoch_step=4)) == marked[12:]


def one_worker(tmp_path, name: str, *flags: str) -> dict:
    """In this process, with the flags of the driver runs it is compared with."""
    config, _ = parse_config([*CATALOG, *EXACT, "--output-dir", str(tmp_path), "--run-name",
                              name, *flags])
    job = prepare_job(config)
    write_run_folder(job)
    train_worker(job, WorkerEnv(), LocalSync(), NullLogger())
    return weights(tmp_path / name)


def test_k_micro_batches_on_one_worker_equal_one_batch_of_k_times_b(tmp_path):
    # 141 images: 29 batches of 5 in 10 steps of 3 (the last: 2 micro-batches, 6 images),
    # the steps of batch 15.
    accumulated = one_worker(tmp_path, "accumulated", "-b", "5", "--accum-steps", "3")
    reference = one_worker(tmp_path, "reference", "-b", "15")
    plain = one_worker(tmp_path, "plain", "-b", "5")
    assert accumulated["step"] == reference["step"] == 10
    assert relative_difference(reference["model"], accumulated["model"]) < 1e-9
    assert relative_difference(reference["model"], plain["model"]) > 1e-3  # sanity
    # the LR scales with the effective batch (per 256 images: 0.4 x 15 / 256)
    for state in (accumulated, reference):
        assert state["optimizer"]["param_groups"][0]["initial_lr"] == pytest.approx(0.4 * 15 / 256)
    assert plain["optimizer"]["param_groups"][0]["initial_lr"] == pytest.approx(0.4 * 5 / 256)


@pytest.fixture(scope="module")
def batch_30_reference(tmp_path_factory):
    return one_worker(tmp_path_factory.mktemp("batch30"), "one", "-b", "30")


@pytest.mark.parametrize("sync", ["ps", "allreduce"])
def test_two_workers_accumulating_match_one_worker_with_the_whole_batch(batch_30_reference,
                                                                          tmp_path, sync):
    # 15 pipeline steps of 2 x 5 in 5 optimizer steps of 3; the last micro-batch has 1 image,
    # worker 1 none (DDP's empty-worker path with accumulated gradients).
    result = run_driver(*CATALOG, *EXACT, "-b", "5", "--accum-steps", "3", "--devices",
                        "cpu,cpu", "--sync", sync, "--run-name", "two", cwd=tmp_path)
    assert result.returncode == 0, result.stderr  # replica checksums agreed every step
    two = weights(tmp_path / "runs" / "two")
    assert two["step"] == batch_30_reference["step"] == 5
    assert relative_difference(batch_30_reference["model"], two["model"]) < 1e-9


def small_model() -> torch.nn.Module:
    """The same weights every time, without the global generator (threads share it)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3)).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, dtype=torch.float64, generator=generator) / 3)
    return model


def micro_batch(step: int, rank: int, micro: int, images: int) -> torch.Tensor:
    seed = step * 100 + rank * 10 + micro
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(images, 6, dtype=torch.float64, generator=generator)


def accumulate(sync, model, rank: int, step: int) -> dict[str, torch.Tensor]:
    """One optimizer step of this worker's micro-batches; the averaged gradients."""
    sizes = MICRO_BATCHES[rank][step]
    for micro, images in enumerate(sizes):
        with sync.step(images, last=micro == len(sizes) - 1) as loss_scale:
            if images:
                (model(micro_batch(step, rank, micro, images)).square().mean()
                 * loss_scale).backward()
    assert sync.finish_step() == sum(sum(MICRO_BATCHES[r][step]) for r in MICRO_BATCHES)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def whole_batch_gradients(step: int) -> dict[str, torch.Tensor]:
    model = small_model()
    inputs = torch.cat([micro_batch(step, rank, micro, images)
                        for rank in MICRO_BATCHES
                        for micro, images in enumerate(MICRO_BATCHES[rank][step])])
    model(inputs).square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def assert_whole_batch_gradients(results: dict) -> None:
    for step in range(len(MICRO_BATCHES[0])):
        expected = whole_batch_gradients(step)
        for rank in MICRO_BATCHES:
            for name, grad in results[rank][step].items():
                assert torch.allclose(grad, expected[name], rtol=1e-12, atol=1e-14), \
                    (step, rank, name)


def ps_worker_thread(links, rank: int, recorder: Recorder, results: dict) -> None:
    model = small_model()
    sync = ParameterServerSync(links, WorkerEnv(rank, 2, "cpu"), Watch(timeout_s=30),
                               bucket_mb=200 / 2**20, check_every=1,  # several buckets
                               signals=RecordingWorker(recorder, rank))
    sync.prepare(model)
    results[rank] = [accumulate(sync, model, rank, step) for step in range(2)]
    results[rank, "buckets"] = len(sync.layout)
    sync.close()


def test_parameter_server_hands_over_the_summed_buckets_once_per_optimizer_step():
    recorder, results = Recorder(), {}
    links = ServerLinks(queue.Queue(), [queue.Queue(), queue.Queue()])
    server = threading.Thread(target=run_server, args=(links, 30, RecordingServer(recorder)))
    workers = [threading.Thread(target=ps_worker_thread, args=(links, rank, recorder, results))
               for rank in MICRO_BATCHES]
    for thread in [server, *workers]:
        thread.start()
    for thread in [*workers, server]:
        thread.join(timeout=60)
    assert 0 in results and 1 in results
    assert_whole_batch_gradients(results)
    for rank in MICRO_BATCHES:  # a hand-over per bucket and optimizer step, not micro-batch
        buckets = results[rank, "buckets"]
        assert buckets >= 2
        handed = [b for what, r, b, _ in recorder.log if what == "wrote" and r == rank]
        assert sorted(handed) == sorted(list(range(buckets)) * 2)


def test_allreduce_exchanges_once_per_optimizer_step():
    """One process (gloo): DDP's own communication hook counts the bucket all-reduces."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        sync = AllReduceSync(WorkerEnv(0, 1, "cpu"), bucket_mb=25, check_every=100)
        ddp = sync.prepare(small_model())
        exchanged = []

        def counting_hook(state, bucket):
            exchanged.append(bucket.index())
            return allreduce_hook(state, bucket)
        ddp.register_comm_hook(None, counting_hook)
        model = ddp.module
        sizes = MICRO_BATCHES[0]
        for step in range(len(sizes)):
            for micro, images in enumerate(sizes[step]):
                with sync.step(images, last=micro == len(sizes[step]) - 1) as loss_scale:
                    (ddp(micro_batch(step, 0, micro, images)).square().mean()
                     * loss_scale).backward()
            assert sync.finish_step() == sum(sizes[step])
            assert len(exchanged) == step + 1  # one bucket, one all-reduce per step
            inputs = torch.cat([micro_batch(step, 0, micro, images)
                                for micro, images in enumerate(sizes[step])])
            reference = small_model()
            reference(inputs).square().mean().backward()
            for p, expected in zip(model.parameters(), reference.parameters()):
                assert torch.allclose(p.grad, expected.grad, rtol=1e-12, atol=1e-14)
            ddp.zero_grad(set_to_none=True)
    finally:
        dist.destroy_process_group()


class StopAfter(NoRequests):
    """A save-and-stop request (as after SIGTERM) answered after optimizer step `step`."""

    def __init__(self, step: int):
        self.step, self.polled = step, []

    def poll(self, rank: int, step: int) -> Action:
        self.polled.append(("trained", step))
        return Action(stop=step == self.step)

    def checkpointed(self, rank: int, step: int) -> Action:
        self.polled.append(("checkpointed", step))
        return Action()


def test_a_stop_mid_epoch_saves_between_optimizer_steps_and_resumes_exactly(tmp_path):
    # 320 images: 40 batches of 8 per epoch, 14 optimizer steps of 3 (the last: 1 batch);
    # mixup/cutmix: each micro-batch draws its own, and the resumed run draws them again.
    flags = ("-b", "8", "--accum-steps", "3", "--epochs", "2", "-p", "4", "--mixup-alpha",
             "0.2", "--cutmix-alpha", "1.0")
    logged = MetricsRecorder()
    straight = train_in_process(tmp_path, *flags, "--run-name", "straight")
    assert isinstance(train_worker(straight, WorkerEnv(), LocalSync(), logged), Finished)
    intervals = [(r["progress/epoch_step"], r["progress/epoch_steps"]) for r in logged.rows
                 if "train/loss" in r]
    assert intervals == [(4, 14), (8, 14), (12, 14), (14, 14)] * 2

    stopped = train_in_process(tmp_path, *flags, "--run-name", "stopped")
    requests = StopAfter(5)
    outcome = train_worker(stopped, WorkerEnv(), LocalSync(), NullLogger(), requests)
    assert outcome == Stopped(5)
    # the start (a checkpointed point: nothing to save), then after each step
    assert requests.polled == [("checkpointed", 0), *(("trained", s) for s in range(1, 6))]
    last = tmp_path / "stopped" / "checkpoints" / "last.pt"
    saved = weights(tmp_path / "stopped")
    assert (saved["epoch"], saved["epoch_step"], saved["step"]) == (0, 5, 5)
    resumed = train_in_process(tmp_path, *flags, "--resume", str(last))
    assert isinstance(train_worker(resumed, WorkerEnv(), LocalSync(), NullLogger()), Finished)

    a, b = weights(tmp_path / "straight"), weights(tmp_path / "stopped")
    assert (a["step"], a["scheduler"]["last_epoch"]) == (b["step"], b["scheduler"]["last_epoch"]) \
        == (28, 28)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"],
                           b["optimizer"]["state"][key]["momentum_buffer"])

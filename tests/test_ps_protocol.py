"""The parameter server's reduction and its hand-over protocol, on CPU in one process: the
real worker and server code in threads, with signals that record the order of every record
and wait (on a GPU these are CUDA events; see app/parallel/handover.py)."""

import os
import queue
import threading
import time
from collections import Counter

import torch

from app.parallel.buckets import BucketLayout
from app.parallel.ps_server import Reducer, Registration, ServerLinks, reduction_devices, \
    run_server
from app.parallel.ps_worker import ParameterServerSync
from app.parallel.watch import Watch
from app.runtime.devices import WorkerEnv


def test_buckets_are_reduced_on_the_worker_devices_in_turn():
    devices = [torch.device(d) for d in ("cuda:0", "cuda:1", "cuda:0")]  # two share cuda:0
    assert reduction_devices(5, devices) == [torch.device(f"cuda:{i}") for i in (0, 1, 0, 1, 0)]
    assert reduction_devices(3, [torch.device("cpu")] * 2) == [torch.device("cpu")] * 3


def test_the_reducer_averages_several_sources_into_every_inbox_step_after_step():
    grads = [[torch.zeros(4), torch.zeros(2)] for _ in range(3)]
    reducer = Reducer([Registration(os.getpid(), g, [torch.full_like(b, -1.0) for b in g], None,
                                    [], None) for g in grads])
    for step, weights in enumerate([(1, 2, 3), (4, 0, 4)]):  # the buffers are reused
        for worker, weight in enumerate(weights):
            for bucket in grads[worker]:
                bucket.copy_(torch.arange(float(bucket.numel())) * (worker + 1 + step) * weight)
        for bucket in range(2):
            reducer.reduce(bucket, sum(weights))
        expected = [sum(torch.arange(float(n)) * (w + 1 + step) * weight
                        for w, weight in enumerate(weights)) / sum(weights) for n in (4, 2)]
        for inbox in reducer.inboxes:
            assert torch.allclose(inbox[0], expected[0]) and torch.allclose(inbox[1], expected[1])
    reducer.reduce(0, 0)  # a step without images anywhere averages to zero
    assert all(torch.equal(inbox[0], torch.zeros(4)) for inbox in reducer.inboxes)


def test_channels_last_gradients_travel_in_memory_order_without_copies():
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    params = list(conv.parameters())
    conv(torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last)).square().sum().backward()
    grad = params[0].grad.clone()
    assert grad.is_contiguous(memory_format=torch.channels_last)
    layout = BucketLayout.for_params(params, bucket_mb=1)
    (bucket,) = layout.views(layout.allocate("cpu", shared=False))
    layout.pack(0, params, bucket, scale=2.0)
    weight_part = bucket[params[1].numel():]  # parameters go in reverse order: bias first
    # memory order of a channels_last weight is (out, kh, kw, in): the bucket holds it as is
    assert torch.equal(weight_part, 2 * grad.permute(0, 2, 3, 1).reshape(-1))
    params[0].grad = None
    layout.unpack(0, params, bucket)
    assert torch.equal(params[0].grad, 2 * grad)
    assert params[0].grad.is_contiguous(memory_format=torch.channels_last)


class Recorder:
    """A shared log of (event, worker, bucket, how many times before) in call order."""

    def __init__(self):
        self.log, self.counts, self.lock = [], Counter(), threading.Lock()

    def note(self, what: str, worker: int, bucket: int) -> None:
        with self.lock:
            key = (what, worker, bucket)
            self.log.append((*key, self.counts[key]))
            self.counts[key] += 1

    def position(self, what: str, worker: int, bucket: int, step: int) -> int:
        return self.log.index((what, worker, bucket, step))


class RecordingWorker:
    def __init__(self, recorder: Recorder, rank: int):
        self.recorder, self.rank = recorder, rank

    def wrote_gradients(self, bucket):
        time.sleep(0.005)  # a message sent before this record would be seen by the server
        self.recorder.note("wrote", self.rank, bucket)

    def wait_for_average(self, bucket):
        self.recorder.note("waited", self.rank, bucket)

    def for_server(self):
        return None


class RecordingServer:
    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def wait_for_gradients(self, worker, bucket):
        self.recorder.note("server waited", worker, bucket)

    def wrote_average(self, worker, bucket):
        self.recorder.note("server wrote", worker, bucket)


def train_worker_thread(links, rank, recorder, steps, models):
    torch.manual_seed(rank)  # different initial weights: the server's broadcast evens them
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    sync = ParameterServerSync(links, WorkerEnv(rank, 2, "cpu"), Watch(timeout_s=30),
                               bucket_mb=200 / 2**20, check_every=1,  # 2 buckets
                               signals=RecordingWorker(recorder, rank))
    sync.prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        inputs = torch.randn(4 + rank, 6, generator=torch.Generator().manual_seed(step * 2 + rank))
        with sync.step(len(inputs)):
            model(inputs).square().mean().backward()
        assert sync.finish_step() == 9  # 4 + 5 images across both workers
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync.close()
    models[rank] = model


def test_hand_over_order_holds_for_every_bucket_and_step():
    recorder, steps = Recorder(), 3
    links = ServerLinks(queue.Queue(), [queue.Queue(), queue.Queue()])
    server = threading.Thread(target=run_server, args=(links, 30, RecordingServer(recorder)))
    models = {}
    workers = [threading.Thread(target=train_worker_thread, args=(links, r, recorder, steps,
                                                                   models)) for r in (0, 1)]
    for thread in [server, *workers]:
        thread.start()
    for thread in [*workers, server]:
        thread.join(timeout=60)
    assert set(models) == {0, 1}  # both finished, the server saw matching checksums
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    buckets = {bucket for _, _, bucket, _ in recorder.log}
    assert len(buckets) >= 2
    at = recorder.position
    for bucket in buckets:
        for step in range(steps):
            for rank in (0, 1):
                # announced only after it was recorded; read only after the wait; the worker
                # unpacks only after the server marked its write
                assert at("wrote", rank, bucket, step) < at("server waited", rank, bucket, step)
                assert at("server waited", rank, bucket, step) < at("server wrote", 0, bucket,
                                                                     step)
                assert at("server wrote", rank, bucket, step) < at("waited", rank, bucket, step)
                if step + 1 < steps:  # buffers reused: nobody overwrites what is still read
                    assert at("waited", rank, bucket, step) < at("wrote", rank, bucket, step + 1)
                    assert at("waited", rank, bucket, step) < at("server wrote", rank, bucket,
                                                                  step + 1)

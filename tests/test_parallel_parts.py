"""The pieces of data parallelism, in one process: buckets, the syncgrads loop, liveness."""

import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from app.models.factory import create_model
from app.parallel.sync import compare_checksums, weights_checksum
from app.parallel.buckets import BucketHooks, BucketLayout
from app.parallel.plans import choose_sync
from app.parallel.ps_server import Reducer, Registration, ServerLinks, syncgrads
from app.parallel.watch import SyncFailure, Watch
from app.runtime.liveness import descendants, is_alive
from app.runtime.devices import LaunchEnv, cpu_threads, worker_devices
from app.runtime.errors import UserError


def test_buckets_cover_every_parameter_once_in_backward_order():
    model = create_model("resnet18", num_classes=10)
    params = list(model.parameters())
    layout = BucketLayout.for_params(params, bucket_mb=5)
    flat = [i for bucket in layout.buckets for i in bucket]
    assert sorted(flat) == list(range(len(params)))
    assert flat == list(reversed(range(len(params))))  # fc first: backward reaches it first
    sizes = [sum(n) * 4 / 2**20 for n in layout.numels]
    assert len(layout) > 1 and all(s < 5 + 9.1 for s in sizes)  # <= limit + one tensor
    assert all(s >= 5 for s in sizes[:-1])


def test_pack_scales_and_unpack_restores():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    params[0].grad = torch.randn(3, 2)
    layout = BucketLayout.for_params(params, bucket_mb=1)
    (bucket,) = layout.views(layout.allocate("cpu", shared=True))
    layout.pack(0, params, bucket, scale=3.0)
    assert torch.equal(bucket[:4], torch.zeros(4))  # params[1] has no grad: zeros
    assert torch.allclose(bucket[4:], 3 * params[0].grad.reshape(-1))
    layout.unpack(0, params, torch.arange(10.0))
    assert torch.equal(params[1].grad, torch.arange(4.0))
    assert torch.equal(params[0].grad, torch.arange(4.0, 10.0).view(3, 2))


def test_hooks_report_each_bucket_once_during_backward():
    model = create_model("test_resnet", num_classes=10)
    layout = BucketLayout.for_params(list(model.parameters()), bucket_mb=0.2)
    ready = []
    hooks = BucketHooks(model, layout, ready.append)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert sorted(ready) == list(range(len(layout)))
    assert ready[0] == 0  # the classifier's bucket is complete first
    hooks.reset()
    ready.clear()
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert sorted(ready) == list(range(len(layout)))


def links_for(workers: int) -> ServerLinks:
    return ServerLinks(queue.Queue(), [queue.Queue() for _ in range(workers)])


def reducer_for(grads: list[list[torch.Tensor]]) -> Reducer:
    """A server's view of workers whose gradient buckets are `grads` (CPU, one process)."""
    return Reducer([Registration(os.getpid(), g, [torch.zeros_like(b) for b in g], None, [],
                                 None) for g in grads])


def test_syncgrads_averages_weighted_by_images_and_answers_everyone():
    links = links_for(3)
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([4.0, 4.0]), torch.tensor([0.0, 0.0])]
    weights = [2, 6, 0]  # worker 2 had no images in this step
    reducer = reducer_for([[g * w] for g, w in zip(grads, weights)])  # grads x images
    for rank, weight in enumerate(weights):
        links.inbox.put(("grads", rank, 0, 0, weight))
    for rank in range(3):
        links.inbox.put(("reduce", rank, 0, "sum", np.array([rank, 1.0])))
        links.inbox.put(("done", rank))
    syncgrads(links, Watch(timeout_s=5), reducer, ["w"])
    expected = (2 * grads[0] + 6 * grads[1]) / 8
    for inbox in reducer.inboxes:  # every worker receives the average in its own buffer
        assert torch.allclose(inbox[0], expected)
    for outbox in links.outboxes:
        assert outbox.get_nowait() == ("avg", 0, 0, 8)
        kind, key, total = outbox.get_nowait()
        assert (kind, key) == ("reduced", 0) and total.tolist() == [3.0, 3.0]


def test_syncgrads_stops_the_run_when_replicas_diverge():
    links = links_for(2)
    model = torch.nn.Linear(3, 2)
    same = weights_checksum(list(model.parameters()))
    with torch.no_grad():
        model.bias[1] += 1e-6  # a change float32 can represent
    links.inbox.put(("checksum", 0, 200, same))
    links.inbox.put(("checksum", 1, 200, weights_checksum(list(model.parameters()))))
    with pytest.raises(SyncFailure, match=r"replicas diverged at step 200: worker 1 differs "
                                          r"from worker 0 in 1 of 2 parameter tensors "
                                          r"\(first: bias\)"):
        syncgrads(links, Watch(timeout_s=5), reducer_for([[torch.zeros(1)], [torch.zeros(1)]]),
                  ["weight", "bias"])


def test_identical_checksums_pass():
    model = torch.nn.Linear(3, 2)
    compare_checksums(1, [weights_checksum(list(model.parameters()))] * 3, ["weight", "bias"])


def test_a_wait_notices_a_dead_peer_quickly():
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    watch = Watch(peers={"worker 1": peer.pid}, timeout_s=60)
    started = time.monotonic()
    with pytest.raises(SyncFailure, match=r"worker 1 \(pid \d+\) is gone"):
        watch.receive(queue.Queue(), "gradients")
    assert time.monotonic() - started < 3
    peer.wait()


def test_a_worker_that_finished_may_exit_before_the_others():
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    links = links_for(2)
    links.inbox.put(("done", 1))
    # Worker 0 (this process) takes longer: it writes the final checkpoint.
    threading.Timer(1.5, links.inbox.put, [("done", 0)]).start()
    watch = Watch(peers={"worker 0": os.getpid(), "worker 1": finished.pid}, timeout_s=60)
    syncgrads(links, watch, reducer_for([[torch.zeros(1)], [torch.zeros(1)]]), ["w"])


class ArrivesAfterTheTimeout(queue.Queue):
    """The last message of a peer that exits right after sending: the timed get misses it."""

    def __init__(self, message):
        super().__init__()
        self.message = message

    def get(self, block=True, timeout=None):
        if self.message is not None:
            self.put(self.message)
            self.message = None
            raise queue.Empty
        return super().get(block, timeout)


def test_the_last_message_of_a_peer_that_exited_is_still_read():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    watch = Watch(peers={"worker 1": gone.pid}, timeout_s=60)
    assert watch.receive(ArrivesAfterTheTimeout(("done", 1)), "gradients") == ("done", 1)
    with pytest.raises(SyncFailure, match=r"worker 1 \(pid \d+\) is gone"):
        watch.receive(queue.Queue(), "gradients")


def test_a_wait_gives_up_after_its_timeout():
    with pytest.raises(SyncFailure, match="no gradients for 1 s although every process is "
                                          "alive"):
        Watch(timeout_s=1).receive(queue.Queue(), "gradients")


def test_liveness_helpers():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert is_alive(child.pid) and child.pid in descendants(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert not is_alive(child.pid)


def test_sync_mode_choice():
    assert choose_sync("auto", ["cpu"], None) == "local"
    assert choose_sync("auto", ["cpu", "cpu"], None) == "ps"
    assert choose_sync("allreduce", ["cpu", "cpu"], None) == "allreduce"
    torchrun = LaunchEnv(rank=3, world_size=16, local_rank=3)
    assert choose_sync("auto", ["cpu"], torchrun) == "allreduce"
    with pytest.raises(UserError, match="under torchrun use --sync allreduce"):
        choose_sync("ps", ["cpu"], torchrun)
    with pytest.raises(UserError, match="unknown --sync mode 'gossip'; known: auto, ps, "
                                        "allreduce"):
        choose_sync("gossip", ["cpu", "cpu"], None)  # never a silent fall into all-reduce


def test_device_lists():
    assert worker_devices(0, ["cpu", "cpu", "cpu"], "auto") == ["cpu"] * 3
    assert worker_devices(0, [], "cpu") == ["cpu"]
    with pytest.raises(UserError, match="unknown device 'tpu:0'|not supported"):
        worker_devices(0, ["tpu:0"], "auto")
    assert LaunchEnv.from_environ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == \
        LaunchEnv(1, 4, 1)
    assert LaunchEnv.from_environ({}) is None


def test_cpu_workers_share_the_cores_within_omp_num_threads(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [cpu_threads(n) for n in (1, 2, 4, 32)] == [16, 8, 4, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert [cpu_threads(n) for n in (1, 2, 4)] == [6, 6, 4]
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    assert cpu_threads(1) == 16

"""The speed switches' plumbing on CPU: torch.compile with the parameter server's bucket hooks
and with DDP, one compilation per mode and region whatever the batch sizes, buckets handed
over during a compiled backward, clean checkpoints. The `aot_eager` backend traces and
differentiates like inductor but generates no code, so these run in seconds; the inductor path
runs in tests/test_gpu.py."""

import json
import queue
import threading
from datetime import timedelta

import pytest
import timm
import torch
import torch.distributed as dist

from app.loggers.jsonl import JsonlLogger
from app.parallel.sync import LocalSync
from app.parallel.plans import free_port
from app.parallel.buckets import BucketHooks, BucketLayout
from app.parallel.messages import ServerLinks
from app.parallel.ps_server import run_server
from app.parallel.ps_worker import ParameterServerSync
from app.parallel.watch import Watch
from app.runtime.devices import WorkerEnv
from app.training import checkpoint
from app.training.speed import CompiledForFullBatches, compile_enabled
from app.training.trainer import Finished, train_worker
from test_ps_protocol import Recorder, RecordingServer, RecordingWorker
from test_train import train_in_process


def test_compile_is_on_for_cuda_by_default_and_on_request_anywhere():
    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    assert compile_enabled("auto", cuda) and not compile_enabled("auto", cpu)
    assert compile_enabled("on", cpu) and not compile_enabled("off", cuda)


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given and the times they run; it
    runs them as traced."""

    def __init__(self):
        self.graphs = 0
        self.runs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1

        def run(*args):
            self.runs += 1
            return graph_module.forward(*args)
        return run


def small_model():
    """No stages: compiled whole, as one region."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(4, 2))


def resnet(arch="test_resnet"):
    """Four stages: each block is a region."""
    torch.manual_seed(0)
    return timm.create_model(arch, num_classes=3)


def test_short_batches_run_eagerly_instead_of_recompiling():
    torch._dynamo.reset()
    backend = CountingBackend()
    model = CompiledForFullBatches(small_model(), batch_size=8, backend=backend)
    for size in (8, 8, 3, 8, 5, 1, 8):  # a short last batch, batches with skipped images
        model(torch.randn(size, 3, 6, 6)).sum().backward()
    assert backend.graphs == 1
    model.eval()
    with torch.no_grad():
        model(torch.randn(8, 3, 6, 6))
        model(torch.randn(2, 3, 6, 6))
    assert backend.graphs == 2  # one more graph for eval mode, none for the short batch
    assert checkpoint.unwrap(model) is model.module  # checkpoints see the bare model
    assert len(list(model.parameters())) == len(list(model.module.parameters()))


@pytest.mark.parametrize("arch, blocks, graphs", [
    ("test_resnet", 4, 4),  # one block per stage, all of other shapes: a graph each
    ("resnet18", 8, 7),  # layer1's two blocks are alike: one graph for both
])
def test_every_block_runs_compiled_with_one_graph_per_mode(arch, blocks, graphs):
    """The blocks share one forward: resnet18's 14 graphs (train and eval) are past dynamo's
    default limit of 8 per code object, beyond which blocks would silently run eagerly."""
    torch._dynamo.reset()
    backend = CountingBackend()
    images = torch.randn(4, 3, 32, 32)
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        model = CompiledForFullBatches(resnet(arch), batch_size=4, backend=backend)
        for size in (4, 4, 3, 4, 4):
            runs = backend.runs
            model(images[:size]).sum().backward()
            assert backend.runs - runs == (blocks if size == 4 else 0)
        assert backend.graphs == graphs  # none more after the first step: no recompiles
        model.eval()
        with torch.no_grad():
            for size in (4, 2, 4):
                runs = backend.runs
                model(images[:size])
                assert backend.runs - runs == (blocks if size == 4 else 0)
    assert backend.graphs == 2 * graphs
    assert [k for k, _ in model.module.state_dict().items()] == list(resnet(arch).state_dict())


def test_bucket_hooks_fire_for_a_compiled_model():
    torch._dynamo.reset()
    eager, compiled = small_model(), small_model()
    layout = BucketLayout.for_params(list(compiled.parameters()), bucket_mb=40 / 2**20)  # 3 buckets
    ready = []
    BucketHooks(compiled, layout, ready.append)
    inputs = torch.randn(8, 3, 6, 6)
    torch.compile(compiled, backend="aot_eager")(inputs).square().sum().backward()
    eager(inputs).square().sum().backward()
    assert len(layout) > 1 and sorted(ready) == list(range(len(layout)))  # each bucket once
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


@pytest.mark.parametrize("make_model, size", [(small_model, 6), (resnet, 32)])
def test_compiled_ddp_computes_the_eager_gradients(make_model, size):
    """Whole (dynamo's DDPOptimizer splits the graph) and by regions (DDP's hooks fire per
    region, as in eager mode); gradients as views of DDP's buckets, as allreduce.py has them."""
    torch._dynamo.reset()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        eager, wrapped = make_model(), make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(wrapped, gradient_as_bucket_view=True)
        inputs = torch.randn(8, 3, size, size)
        CompiledForFullBatches(ddp, 8, "aot_eager")(inputs).square().sum().backward()
        eager(inputs).square().sum().backward()
        for a, b in zip(eager.parameters(), wrapped.parameters()):
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    finally:
        dist.destroy_process_group()


def node_making_grad_of(root: torch.autograd.graph.Node, param: torch.Tensor):
    """The backward node whose output `param`'s AccumulateGrad receives."""
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is not None and getattr(child, "variable", None) is param:
                return node
            if child is not None and child not in seen:
                seen.add(child)
                todo.append(child)
    raise AssertionError("no gradient flows to the parameter")


def test_buckets_leave_during_a_compiled_backward():
    """Issue 18. The stem's first conv makes the last gradient of backward; before that node
    starts, every bucket without stem parameters must have been handed over to the real
    parameter server. The order of events is recorded, nothing is timed. With the whole model
    compiled (one backward node) no bucket leaves before."""
    torch._dynamo.reset()
    recorder = Recorder()
    links = ServerLinks(queue.Queue(), [queue.Queue()])
    server = threading.Thread(target=run_server, args=(links, 30, RecordingServer(recorder)))
    server.start()
    model = resnet()
    sync = ParameterServerSync(links, WorkerEnv(0, 1, "cpu"), Watch(timeout_s=30),
                               bucket_mb=2**16 / 2**20, check_every=10**9,  # 64 KB: 8 buckets
                               signals=RecordingWorker(recorder, 0))
    compiled = CompiledForFullBatches(sync.prepare(model), batch_size=4, backend="aot_eager")
    with sync.step(4):
        loss = compiled(torch.randn(4, 3, 32, 32)).square().mean()
        stem_conv = node_making_grad_of(loss.grad_fn, next(model.parameters()))
        stem_conv.register_prehook(lambda grads: recorder.note("stem conv starts", 0, -1))
        loss.backward()
    sync.finish_step()
    sync.close()
    server.join(timeout=60)
    stem = {i for i, (name, _) in enumerate(model.named_parameters())
            if name.split(".")[0] in ("conv1", "bn1")}
    stages = [b for b, members in enumerate(sync.layout.buckets) if not stem & set(members)]
    assert len(stages) >= 5
    at = recorder.position
    for bucket in stages:
        assert at("wrote", 0, bucket, 0) < at("stem conv starts", 0, -1, 0)


def test_a_compiled_run_logs_its_compile_time_and_saves_plain_keys(tmp_path):
    torch._dynamo.reset()
    job = train_in_process(tmp_path, "--epochs", "1", "--run-name", "compiled", "--compile",
                           "on", "--compile-backend", "aot_eager", "--classes", "5")
    outcome = train_worker(job, WorkerEnv(), LocalSync(), JsonlLogger(tmp_path / "m.jsonl"))
    assert isinstance(outcome, Finished) and outcome.metrics["val/images"] == 50
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    compiled = [r for r in records if "compile/first_step_s" in r]
    assert len(compiled) == 1 and compiled[0]["step"] == 1
    assert compiled[0]["compile/first_step_s"] > 0
    state = checkpoint.load(tmp_path / "compiled" / "checkpoints" / "last.pt")
    timm.create_model("test_resnet", num_classes=5).load_state_dict(state["model"])  # strict


@pytest.mark.parametrize("saved, device, expected", [
    (None, "cuda:1", None),  # saved on a CPU worker
    ("one", "cpu", None),  # a CPU worker has no CUDA generator to restore
    ("one", "cuda:3", "one"),  # this worker's own state
    (["s0", "s1"], "cuda:1", "s1"),  # earlier versions saved one state per GPU
    (["s0", "s1"], "cuda:5", "s0"),  # ... from a machine with fewer GPUs than this index
])
def test_the_cuda_generator_state_for_this_device(saved, device, expected):
    states = {} if saved is None else {"cuda": saved}
    assert checkpoint.cuda_rng_state(states, device) == expected


def test_cpu_workers_save_no_cuda_generator():
    assert "cuda" not in checkpoint.rng_states("cpu")

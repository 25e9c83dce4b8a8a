"""The speed switches' plumbing on CPU: torch.compile with the parameter server's bucket hooks
and with DDP, one compilation per mode whatever the batch sizes, clean checkpoints. The
`aot_eager` backend traces and differentiates like inductor but generates no code, so these
run in seconds; the inductor path runs in tests/test_gpu.py."""

import json
from datetime import timedelta

import pytest
import timm
import torch
import torch.distributed as dist

from app import checkpoint
from app.devices import WorkerEnv
from app.loggers.jsonl import JsonlLogger
from app.parallel import LocalSync
from app.parallel.allreduce import free_port
from app.parallel.buckets import BucketHooks, BucketLayout
from app.speed import CompiledForFullBatches, compile_enabled
from app.train import Finished, train_worker
from test_train import train_in_process


def test_compile_is_on_for_cuda_by_default_and_on_request_anywhere():
    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    assert compile_enabled("auto", cuda) and not compile_enabled("auto", cpu)
    assert compile_enabled("on", cpu) and not compile_enabled("off", cuda)


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given and runs them as traced."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(4, 2))


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


def test_compiled_ddp_computes_the_eager_gradients():
    torch._dynamo.reset()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        eager, wrapped = small_model(), small_model()
        ddp = torch.nn.parallel.DistributedDataParallel(wrapped)
        inputs = torch.randn(8, 3, 6, 6)
        CompiledForFullBatches(ddp, 8, "aot_eager")(inputs).square().sum().backward()
        eager(inputs).square().sum().backward()
        for a, b in zip(eager.parameters(), wrapped.parameters()):
            assert torch.allclose(a.grad, b.grad, atol=1e-6)
    finally:
        dist.destroy_process_group()


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

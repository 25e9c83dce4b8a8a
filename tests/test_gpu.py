"""The GPU paths, on a GPU (skipped without one; `gpu2` tests need two). They are what
`python3 bin/bench.py gpu-check` runs on a GPU machine.

Tolerances: float64 runs agree to 1e-9 whatever the reduction order; float32 with TF32 off to
1e-4 (cuDNN may pick other algorithms, which reorder sums, over 15 steps); bf16 autocast to 2e-2
(the rounding of activations and gradients differs with the batch split).
"""

import json

import pytest
import torch

from app.config.sources import parse_config
from app.launch.run import prepare_job, write_run_folder
from app.parallel.sync import LocalSync
from app.runtime.devices import WorkerEnv
from app.runtime.interrupts import Action, NoRequests
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE
from app.training import checkpoint, run_state
from app.training.trainer import Trainer
from conftest import REPO, TINY_TRAIN_FLAGS, run_driver
from test_parallel import EXACT, relative_difference, weights
from exact_runs import last, stop_with_sigterm_after

CATALOG = ("--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny")
NUMERICS = {  # flags that replace EXACT's float64, and the tolerance they allow
    "float64": ((), 1e-9),
    "float32, TF32 off": (("--dtype", "float32", "--no-tf32"), 1e-4),
    "bf16, channels_last": (("--dtype", "float32", "--amp", "bf16", "--channels-last"), 2e-2),
}


def epoch_records(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, [r for r in rows if "val/top1" in r]


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("sync", ["ps", "allreduce"])
def test_two_workers_sharing_one_gpu_match_one_worker(tmp_path, sync, numerics):
    """CUDA IPC buckets and events (ps); gloo on CUDA tensors (allreduce: NCCL refuses two
    ranks on one GPU). Compile off: equivalence is about the sync, compile is tested below."""
    extra, tolerance = NUMERICS[numerics]
    flags = [*CATALOG, *EXACT, *extra, "--device", "cuda:0", "--compile", "off"]
    one = run_driver(*flags, "-b", "10", "--run-name", "one", cwd=tmp_path)
    two = run_driver(*flags, "-b", "5", "--devices", "cuda:0,cuda:0", "--sync", sync,
                     "--run-name", "two", cwd=tmp_path)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    a, b = weights(tmp_path / "runs" / "one"), weights(tmp_path / "runs" / "two")
    assert a["step"] == b["step"] == 15
    assert relative_difference(a["model"], b["model"]) < tolerance


@pytest.mark.gpu
@pytest.mark.gpu2
@pytest.mark.parametrize("sync", ["ps", "allreduce"])
def test_two_gpus_match_one(tmp_path, sync):
    """The parameter server's reduction across devices (peer copies onto each bucket's
    reduction GPU) and NCCL, both against one worker with twice the batch."""
    flags = [*CATALOG, *EXACT, "--compile", "off"]
    one = run_driver(*flags, "--device", "cuda:0", "-b", "10", "--run-name", "one", cwd=tmp_path)
    two = run_driver(*flags, "--gpus", "2", "-b", "5", "--sync", sync, "--run-name", "two",
                     cwd=tmp_path)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    difference = relative_difference(weights(tmp_path / "runs" / "one")["model"],
                                     weights(tmp_path / "runs" / "two")["model"])
    assert difference < 1e-9


@pytest.mark.gpu
@pytest.mark.parametrize("devices", [("--device", "cuda:0"),
                                     ("--devices", "cuda:0,cuda:0", "--sync", "ps"),
                                     ("--devices", "cuda:0,cuda:0", "--sync", "allreduce")])
def test_bf16_channels_last_and_compile_train_the_tiny_sample(tmp_path, devices):
    """The defaults on CUDA: bf16 autocast, channels_last and torch.compile, also with the
    parameter server's bucket hooks and with DDP."""
    result = run_driver(*CATALOG, *TINY_TRAIN_FLAGS, "-b", "16", "--epochs", "4", *devices,
                        "--run-name", "gpu", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows, epochs = epoch_records(tmp_path / "runs" / "gpu")
    assert epochs[-1]["val/top1"] >= 0.6  # chance: 0.1
    compiled = [r for r in rows if "compile/first_step_s" in r]
    assert len(compiled) == 1 and compiled[0]["compile/first_step_s"] > 0
    state = weights(tmp_path / "runs" / "gpu")
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in state["model"])


@pytest.mark.gpu
def test_sigterm_then_resume_on_the_gpu_continues(tmp_path):
    flags = (*CATALOG, *TINY_TRAIN_FLAGS, "--classes", "5", "-b", "8", "--epochs", "2", "-p",
             "1", "--device", "cuda:0")
    code, stderr = stop_with_sigterm_after(tmp_path, (*flags, "--run-name", "cut"), step=5)
    assert code == PREEMPTED_EXIT_CODE, stderr
    cut = last(tmp_path / "runs" / "cut")
    assert 0 < cut["epoch_step"] < 20
    config, _ = parse_config([*flags, "--run-name", "cut", "--resume", "auto",
                              "--output-dir", str(tmp_path / "runs")])
    replica = run_state.load(prepare_job(config), WorkerEnv(device="cuda:0"))["replica"]
    assert isinstance(replica["rng"]["cuda"], torch.Tensor)  # this worker's generator only
    resumed = run_driver(*flags, "--run-name", "cut", "--resume", "auto", cwd=tmp_path,
                         timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = last(tmp_path / "runs" / "cut")
    assert (done["epoch"], done["step"]) == (2, 40)
    rows, epochs = epoch_records(tmp_path / "runs" / "cut")
    assert epochs[-1]["train/images"] == 160 and epochs[-1]["epoch"] == 2


class SyncDebugWindow(NoRequests):
    """Requests for the Trainer's loop: after `start` warm-up steps, any host sync inside a
    step raises; the run stops before the epoch's last step (which logs, and may sync)."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop, self.checked = start, stop, 0

    def poll(self, rank: int, step: int) -> Action:
        if step == self.start:
            torch.cuda.set_sync_debug_mode("error")
        if step == self.stop:
            torch.cuda.set_sync_debug_mode("default")
            self.checked = self.stop - self.start
            return Action(save=True, stop=True)
        return Action()


@pytest.mark.gpu
@pytest.mark.parametrize("compile_setting, amp, augment", [
    pytest.param("off", "bf16", (), id="off-bf16"), pytest.param("on", "bf16", (), id="on-bf16"),
    pytest.param("off", "fp16", (), id="off-fp16"),  # fp16: fused step
    pytest.param("off", "bf16", ("--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
                                 "--random-erase", "0.5", "--label-smoothing", "0.1"),
                 id="off-bf16-batch-augment"),  # their random numbers are drawn on the host
    pytest.param("off", "bf16", ("--model-ema", "--model-ema-steps", "2", "--optimizer", "lars",
                                 "--clip-grad-norm", "1.0"), id="off-bf16-ema-lars-clip"),
    pytest.param("off", "bf16", ("--optimizer", "lamb", "--bce-loss", "--accum-steps", "2"),
                 id="off-bf16-lamb-bce-accumulation"),
    # the batch decoded and augmented on the training GPU, in the loop: the host waits for
    # the decoder's own stream only, never for the training stream
    pytest.param("off", "bf16", ("--decoder", "nvjpeg", "--auto-augment", "ta_wide"),
                 id="off-bf16-nvjpeg")])
def test_no_host_sync_inside_a_training_step(tmp_path, compile_setting, amp, augment):
    decoder = () if "--decoder" in augment else ("--decoder", "pillow")  # the step, alone
    config, _ = parse_config([*CATALOG, *TINY_TRAIN_FLAGS, *decoder, "-b", "16", "-j", "2",
                              "-p", "1000",
                              "--device", "cuda:0", "--compile", compile_setting, "--amp", amp,
                              *augment, "--output-dir", str(tmp_path), "--run-name", "nosync"])
    job = prepare_job(config)
    write_run_folder(job)
    steps = 20 // config.train.accum_steps  # 20 batches per epoch
    window = SyncDebugWindow(start=2, stop=steps - 2)
    trainer = Trainer(job, WorkerEnv(device="cuda:0"), LocalSync(), requests=window)
    try:
        assert not trainer.train_epoch()  # stopped by the window, not by an error
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer.close()
    assert window.checked == steps - 4 and trainer.position.step == steps - 2


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer, fused", [("sgd", True), ("adamw", True), ("lars", None)])
def test_sgd_and_adamw_step_as_one_fused_kernel_on_cuda(tmp_path, optimizer, fused):
    config, _ = parse_config([*CATALOG, *TINY_TRAIN_FLAGS, "--device", "cuda:0", "--optimizer",
                              optimizer, "--output-dir", str(tmp_path), "--run-name", "fused"])
    job = prepare_job(config)
    write_run_folder(job)
    trainer = Trainer(job, WorkerEnv(device="cuda:0"), LocalSync())
    try:
        assert trainer.optimizer.defaults.get("fused") is fused  # timm's LARS has no such step
    finally:
        trainer.close()


@pytest.mark.gpu
def test_checkpoints_hold_the_workers_own_cuda_generator():
    torch.cuda.set_device("cuda:0")
    states = checkpoint.rng_states("cuda:0")
    assert isinstance(states["cuda"], torch.Tensor)  # one device's state, not a list
    expected = torch.rand(4, device="cuda:0")
    torch.rand(100, device="cuda:0")
    checkpoint.set_rng_states(states, "cuda:0")
    assert torch.equal(torch.rand(4, device="cuda:0"), expected)
    # a checkpoint of an earlier version (one state per GPU of an 8-GPU machine) still loads
    checkpoint.set_rng_states({**states, "cuda": [states["cuda"]] * 8}, "cuda:0")
    assert torch.equal(torch.rand(4, device="cuda:0"), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("decoder, auto_augment", [("dali", "off"), ("nvjpeg", "off"),
                                                   ("nvjpeg", "ta_wide")])
def test_gpu_decoders_give_pillows_batches(tiny_sample, decoder, auto_augment):
    """DALI's mixed decoder (the hardware JPEG engine, CUDA for the rest) and torchvision's
    nvJPEG (with the ops on the GPU) against Pillow: the same images, labels and crops; pixels
    within the tolerance the CPU tests state, doubled for the GPU decoders' IDCT and chroma
    upsampling (images that get Equalize left out, as there)."""
    if decoder == "dali":
        pytest.importorskip("nvidia.dali")
    from app.catalog.storage import DatasetRoot
    from app.catalog.tables import load_tables
    from app.data.augment import TrainRecipe
    from app.data.pipeline import InputFormat
    from app.data.sampler import ShardedBatches
    from pipelines import batches_of, equalized, level_difference, spec_for
    root = DatasetRoot("tiny", str(tiny_sample))
    frame = load_tables(root).train
    form = InputFormat(torch.device("cuda:0"), torch.float32, channels_last=True)
    spec = spec_for(root, frame, TrainRecipe(32, auto_augment=auto_augment),
                    ShardedBatches(len(frame), 32, seed=2), 2, form)
    out = {name: batches_of(name, spec, 1, 2) for name in ("pillow", decoder)}
    assert len(out[decoder]) == len(out["pillow"]) == 8
    image_mean = 6.0 if auto_augment == "off" else 12.0
    for step, (a, b) in enumerate(zip(out["pillow"], out[decoder]), start=2):
        assert b.images.is_cuda and b.images.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(a.labels, b.labels) and not b.skipped
        pixels = level_difference(a.images, b.images)[~equalized(root, frame, spec, 1, step)]
        assert pixels.mean() <= 2.0 and pixels.mean(dim=(1, 2, 3)).max() <= image_mean


@pytest.mark.gpu
def test_dali_hands_its_batches_over_on_torchs_current_stream(tiny_sample, monkeypatch,
                                                             caplog):
    """run() gets torch's current stream (the stream, not the host, waits for DALI's GPU
    work), also when that is a side stream; the batches are those made on the default
    stream, to the bit (the same decoder reads the same images). A run() that refused the
    stream would raise, and the batch would be redone with Pillow: no such warning either."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import Pipeline
    from app.catalog.storage import DatasetRoot
    from app.catalog.tables import load_tables
    from app.data.augment import EvalRecipe
    from app.data.decoders import build_pipeline
    from app.data.pipeline import InputFormat, PipelineSpec
    from app.data.sampler import ShardedBatches
    handed = []
    run = Pipeline.run

    def recorded(pipe, *args, **kwargs):
        handed.append(args[0] if args else None)
        return run(pipe, *args, **kwargs)
    monkeypatch.setattr(Pipeline, "run", recorded)
    root = DatasetRoot("tiny", str(tiny_sample))
    frame = load_tables(root).val
    form = InputFormat(torch.device("cuda:0"), torch.float32, channels_last=True)
    spec = PipelineSpec(root, frame, EvalRecipe(32), ShardedBatches(len(frame), 32,
                                                                    shuffle=False), 2, form)
    pipeline = build_pipeline("dali", spec)
    side = torch.cuda.Stream("cuda:0")
    try:
        with caplog.at_level("WARNING", logger="imagenet_dp"):
            default = [(b.images.cpu(), b.labels.cpu()) for b in pipeline.epoch(0)]
            on_default = [s for s in handed if s is not None]  # end_epoch's run() has none
            handed.clear()
            with torch.cuda.stream(side):
                batches = list(pipeline.epoch(0))
            side.synchronize()
            on_side = [s for s in handed if s is not None]
    finally:
        pipeline.close()
    assert "DALI failed" not in caplog.text
    assert len(on_default) == len(on_side) == len(default) == 4  # 100 images, batches of 32
    assert all(s == torch.cuda.default_stream("cuda:0") for s in on_default)
    assert all(s == side for s in on_side)
    for (images, labels), batch in zip(default, batches):
        assert torch.equal(images, batch.images.cpu()) and torch.equal(labels,
                                                                       batch.labels.cpu())

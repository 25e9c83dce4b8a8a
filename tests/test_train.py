"""End to end: the driver trains the tiny sample, saves checkpoints, resumes exactly."""

import copy
import re
import tomllib

import pytest
import timm
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from app.catalog.storage import DatasetRoot
from app.catalog.tables import train_cls_list
from app.config.sources import parse_config
from app.data.augment import EvalRecipe, TrainRecipe
from app.data.sampler import ShardedBatches
from app.launch.run import prepare_job, write_run_folder
from app.loggers import NullLogger
from app.parallel.sync import LocalSync
from app.runtime.devices import WorkerEnv
from app.runtime.private_api import compiled_graphs
from app.training import checkpoint
from app.training.precision import Precision
from app.training.speed import stage_blocks
from app.training.trainer import Trainer, train_worker
from app.training.worker_pipelines import build_pipelines
from conftest import REPO, TINY_TRAIN_FLAGS, run_driver, skipped_rows
from training import CATALOG, HostSyncs, records, straight_and_resumed, train_in_process

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One real driver run: 4 epochs of test_resnet on the tiny sample."""
    cwd = tmp_path_factory.mktemp("driver")
    result = run_driver(*CATALOG, *TINY_TRAIN_FLAGS, "--epochs", "4", "--run-name", "r",
                        "-p", "4", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return cwd, cwd / "runs" / "r", result


def test_training_learns_the_tiny_sample(trained_run):
    _, run_dir, result = trained_run
    epochs = [r for r in records(run_dir) if "val/top1" in r]
    assert [r["epoch"] for r in epochs] == [1, 2, 3, 4]
    assert epochs[-1]["val/top1"] >= 0.6  # chance is 0.1 with 10 classes
    assert epochs[-1]["val/top5"] >= epochs[-1]["val/top1"]
    assert epochs[-1]["train/epoch_loss"] < 0.6 * epochs[0]["train/epoch_loss"]
    assert epochs[-1]["val/images"] == 100  # every val image, once
    assert [r["train/image_size"] for r in epochs] == [32] * 4
    assert result.stdout.count("val top-1") == 4


def test_metrics_are_logged_each_print_interval_with_growing_steps(trained_run):
    _, run_dir, _ = trained_run
    rows = records(run_dir)
    train_rows = [r for r in rows if "train/loss" in r]
    assert len(train_rows) == 4 * 3  # 10 steps per epoch, -p 4: steps 4, 8 and the last
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and steps[-1] == 40


def test_progress_shows_the_wait_for_batches_and_each_epoch_the_time_left(trained_run):
    _, run_dir, result = trained_run
    rows = records(run_dir)
    waits = [r["train/data_wait"] for r in rows if "train/loss" in r]
    assert len(waits) == 12 and all(0 <= wait <= 1 for wait in waits)
    epochs = [r for r in rows if "val/top1" in r]
    times = [r["epoch/time_s"] for r in epochs]
    for done, record in enumerate(epochs, start=1):  # 4 epochs: 3, 2, 1, 0 left
        assert 0 <= record["epoch/data_wait"] <= 1
        assert record["run/remaining_s"] == pytest.approx((4 - done) * sum(times[:done]) / done)
    progress = [line for line in result.stdout.splitlines() if "img/s" in line]
    assert len(progress) == 12 and all(re.search(r"  data \d+%  eta ", line) for line in progress)
    summaries = [line for line in result.stdout.splitlines() if "val top-1" in line]
    assert [bool(re.search(r"  left \d\d:\d\d  ", line)) for line in summaries] == \
        [True, True, True, False]  # nothing left after the last


def test_run_folder_holds_resolved_config_and_checkpoints(trained_run):
    _, run_dir, _ = trained_run
    config = tomllib.loads((run_dir / "config.toml").read_text())
    assert config["data"]["dataset"] == "sample_tiny" and config["data"]["image_size"] == 32
    assert config["model"]["arch"] == "test_resnet" and config["run"]["name"] == "r"
    state = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert (state["epoch"], state["step"]) == (4, 40)
    assert {"optimizer", "scheduler", "replicas", "config", "run_id", "epoch_step"} <= set(state)
    assert state["epoch_step"] == 0  # saved at the end of an epoch
    # Three kept step files; last.pt is another name of the newest.
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt"))
    assert kept == ["step-000000020.pt", "step-000000030.pt", "step-000000040.pt"]
    assert (run_dir / "checkpoints" / "last.pt").samefile(run_dir / "checkpoints" / kept[-1])
    assert all(t.device.type == "cpu" for t in state["model"].values())
    plain = timm.create_model("test_resnet", num_classes=10)
    plain.load_state_dict(state["model"])  # strict, no wrapper prefixes
    best = checkpoint.load(run_dir / "checkpoints" / "best.pt")
    epochs = [r for r in records(run_dir) if "val/top1" in r]
    assert best["best_top1"] == max(r["val/top1"] for r in epochs)


def test_evaluate_only_reproduces_the_last_epochs_accuracy(trained_run):
    cwd, run_dir, _ = trained_run
    result = run_driver(*CATALOG, *TINY_TRAIN_FLAGS, "-e", "--resume", "auto", "--run-name", "r",
                        cwd=cwd)
    assert result.returncode == 0, result.stderr
    last_epoch = [r for r in records(run_dir) if "val/top1" in r][-2]  # before this eval
    evaluation = records(run_dir)[-1]
    assert evaluation["val/top1"] == last_epoch["val/top1"]
    assert f"val top-1 {last_epoch['val/top1']:.4f}" in result.stdout


def test_resume_auto_continues_the_run(trained_run):
    cwd, run_dir, _ = trained_run
    result = run_driver(*CATALOG, *TINY_TRAIN_FLAGS, "--resume", "auto", "--run-name", "r",
                        "--epochs", "5", cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert "epoch 5/5" in result.stdout and "epoch 1/5" not in result.stdout
    assert checkpoint.load(run_dir / "checkpoints" / "last.pt")["step"] == 50


def test_resume_from_last_pt_continues_exactly(tmp_path):
    a, b = straight_and_resumed(tmp_path, 3, 10)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    momentum_a = a["optimizer"]["state"]
    momentum_b = b["optimizer"]["state"]
    assert momentum_a.keys() == momentum_b.keys()
    for key in momentum_a:
        assert torch.equal(momentum_a[key]["momentum_buffer"], momentum_b[key]["momentum_buffer"])
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 30


def test_repeated_augmentation_and_flip_tta_reach_training_and_evaluation(tmp_path):
    job = train_in_process(tmp_path, "--epochs", "1", "--ra-sampler", "--val-flip-tta",
                           "--run-name", "recipes")
    metrics = train_worker(job, WorkerEnv(), LocalSync(), NullLogger()).metrics
    assert metrics["train/images"] == 320 // 3 * 3  # 106 of the 320 images, 3 copies each
    assert metrics["val/images"] == 100 and 0 <= metrics["val/top1"] <= 1
    last = str(tmp_path / "recipes" / "checkpoints" / "last.pt")

    def evaluated(*flags) -> dict:
        again = train_in_process(tmp_path, "-e", "--resume", last, *flags)
        return train_worker(again, WorkerEnv(), LocalSync(), NullLogger()).metrics
    # the epoch's val metrics were the flip-averaged ones
    assert evaluated("--val-flip-tta")["val/loss"] == pytest.approx(metrics["val/loss"])
    assert evaluated()["val/loss"] != pytest.approx(metrics["val/loss"])


def test_resume_repeats_the_batch_augmentations_exactly(tmp_path):
    # 5 classes (160 images): 5 steps of erasing and mixup or cutmix per epoch.
    flags = ("--classes", "5", "--random-erase", "0.5", "--mixup-alpha", "0.2",
             "--cutmix-alpha", "1.0", "--label-smoothing", "0.1")
    a, b = straight_and_resumed(tmp_path, 2, 5, *flags)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"],
                           b["optimizer"]["state"][key]["momentum_buffer"])


PROGRESSIVE = ("--progressive-start-size", "32", "--progressive-end-size", "64",
               "--progressive-start-epoch", "0", "--progressive-end-epoch", "1")


def test_resume_with_progressive_resizing_continues_exactly(tmp_path):
    """Epoch 1 at 32 px, epoch 2 at 64 px: the resumed run takes the size from the epoch."""
    a, b = straight_and_resumed(tmp_path, 2, 5, "--classes", "5", *PROGRESSIVE)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


class Recorder(NullLogger):
    def __init__(self):
        self.rows = []

    def log_metrics(self, step, metrics):
        self.rows.append(metrics)


def test_progressive_resizing_compiles_one_graph_per_size_not_per_step(tmp_path):
    """Regions compiled by dynamo alone (the eager backend: what is compiled, not how): 5 steps
    an epoch at 32 then 64 px; val at 32 px. Each block compiles once per (mode, size) it meets, whatever the steps."""
    torch._dynamo.reset()
    counters.clear()
    job = train_in_process(tmp_path, "--classes", "5", "--epochs", "2", *PROGRESSIVE,
                           "--compile", "on", "--compile-backend", "eager",
                           "--run-name", "progressive")
    recorder = Recorder()
    train_worker(job, WorkerEnv(), LocalSync(), recorder)
    blocks = len(stage_blocks(timm.create_model("test_resnet")))
    epochs = [row for row in recorder.rows if "val/top1" in row]
    assert [row["train/image_size"] for row in epochs] == [32, 64]
    compiles = [row for row in recorder.rows if "compile/graphs" in row]
    # train at 32; then eval at 32 (epoch 1's evaluation) and train at 64
    assert [(row["train/image_size"], row["compile/graphs"]) for row in compiles] == \
        [(32, blocks), (64, 3 * blocks)]
    assert compiled_graphs() == 3 * blocks  # the second evaluation compiled nothing new
    torch._dynamo.reset()


class CrashAtFirstLog(NullLogger):
    """Stands in for a crash before the first checkpoint."""

    def log_metrics(self, step, metrics):
        raise KeyboardInterrupt


def test_skipped_images_are_listed_as_they_are_found(tmp_path, tiny_copy, catalog_for):
    frame = train_cls_list(DatasetRoot("t", str(tiny_copy)))
    first_batch = [i for i, _ in next(iter(ShardedBatches(len(frame), 32, seed=0)))]
    bad = {frame.path[first_batch[0]], frame.path[first_batch[1]]}
    for path in bad:
        (tiny_copy / path).write_bytes(b"")
    config, _ = parse_config(["--catalog", str(catalog_for(tiny_copy)), *TINY_TRAIN_FLAGS,
                              "-p", "1", "--output-dir", str(tmp_path), "--run-name", "crash"])
    job = prepare_job(config)
    write_run_folder(job)
    with pytest.raises(KeyboardInterrupt):
        train_worker(job, WorkerEnv(), LocalSync(), CrashAtFirstLog())
    assert not (tmp_path / "crash" / "checkpoints").exists()  # crashed before any save
    rows = skipped_rows(tmp_path / "crash")
    assert {row["path"] for row in rows} == bad and len(rows) == 2
    assert {(row["epoch"], row["split"], row["reason"]) for row in rows} == {
        ("1", "train", "empty file")}


def test_a_trainers_state_loads_into_a_fresh_trainer(tmp_path):
    job = train_in_process(tmp_path, "--epochs", "2", "--run-name", "state")
    trainer = Trainer(job, WorkerEnv(), LocalSync())
    batches = trainer.train_data.epoch(0)
    for _ in range(3):
        trainer.train_step(next(batches))
        trainer.position.step += 1
        trainer.position.epoch_step += 1
    trainer.interval.add(torch.tensor(2.0), 32, 1)
    state = trainer.state_dict()
    fresh = Trainer(job, WorkerEnv(), LocalSync())
    assert not torch.equal(fresh.model.fc.weight, trainer.model.fc.weight)
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    assert (again["epoch"], again["epoch_step"], again["step"]) == (0, 3, 3)
    assert torch.equal(again["epoch_sums"], state["epoch_sums"])
    assert again["epoch_sums"][1:].tolist() == [32.0, 1.0]
    for key, value in state["model"].items():
        assert torch.equal(again["model"][key], value), key
    assert again["optimizer"]["state"].keys() == state["optimizer"]["state"].keys()
    assert again["scheduler"]["last_epoch"] == state["scheduler"]["last_epoch"] == 3
    trainer.close()
    fresh.close()


def test_fp16_loss_scaling_skips_overflowing_steps_without_asking_the_host(tmp_path):
    job = train_in_process(tmp_path, "--epochs", "1", "--amp", "fp16", "--run-name", "fp16",
                           "--classes", "5")
    trainer = Trainer(job, WorkerEnv(), LocalSync())
    try:
        batches = trainer.train_data.epoch(0)
        params = list(trainer.model.parameters())
        batch = next(batches)
        with HostSyncs() as syncs:
            trainer.train_step(batch)
        assert syncs.calls == []
        # An overflowing step (the largest float32 scale) is skipped on the device...
        trainer.scaler.update(new_scale=torch.finfo(torch.float32).max)
        before = [p.detach().clone() for p in params]
        batch = next(batches)
        with HostSyncs() as syncs:
            trainer.train_step(batch)
        assert syncs.calls == []
        assert all(torch.equal(a, p) for a, p in zip(before, params))
        assert trainer.scaler.get_scale() == torch.finfo(torch.float32).max / 2  # backed off
        # ... and a normal one is not.
        trainer.scaler.update(new_scale=1024.0)
        trainer.train_step(next(batches))
        assert not all(torch.equal(a, p) for a, p in zip(before, params))
    finally:
        trainer.close()
    # The detector sees the per-step sync of an unfused optimizer under the same scaler.
    model = torch.nn.Linear(4, 2)
    optimizer, scaler = torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    with HostSyncs() as syncs:
        scaler.step(optimizer)
    assert syncs.calls


def first_mixed_step(trainer):
    """The first batch, the inputs step 0 trains on (pixels: tests/test_batch_augment.py), its
    mixing lambda by the plan, and a copy of the model to compute the expected loss with."""
    batches = trainer.train_data.epoch(0)
    batch = next(batches)
    inputs, _ = trainer.batch_augment(batch.images.clone(), batch.labels, step=0)
    lam = trainer.batch_augment.plan(len(batch), 32, 32, step=0).mix.lam
    assert 0.2 < lam < 0.8  # far from an unmixed batch
    return batches, batch, inputs, lam, copy.deepcopy(trainer.model)


def test_mixed_targets_meet_label_smoothing_as_in_torchvision_without_host_syncs(tmp_path):
    job = train_in_process(tmp_path, "--epochs", "1", "--run-name", "mix", "--classes", "5",
                           "--random-erase", "0.5", "--mixup-alpha", "1.0", "--cutmix-alpha",
                           "1.0", "--label-smoothing", "0.1",
                           "--amp", "off")  # fp32, as `expected` is computed
    trainer = Trainer(job, WorkerEnv(), LocalSync())
    try:
        batches, batch, inputs, lam, model = first_mixed_step(trainer)
        # torchvision: MixUp/CutMix mix one-hot rows; CrossEntropyLoss(label_smoothing) then
        # smooths the probability targets it is given.
        one_hot = F.one_hot(batch.labels, 5).double()
        mixed = lam * one_hot + (1 - lam) * one_hot.roll(1, 0)
        target = mixed * (1 - 0.1) + 0.1 / 5
        expected = -(target * model(inputs).double().log_softmax(1)).sum(1).mean()
        with HostSyncs() as syncs:
            loss = trainer.train_step(batch)
            for step in range(1, 4):  # mixup and cutmix steps alike
                trainer.position.step = step
                trainer.train_step(next(batches))
        assert syncs.calls == []
        assert torch.allclose(loss.double(), expected, rtol=1e-5, atol=0)
    finally:
        trainer.close()


def test_auto_augment_and_size_flags_reach_the_recipes(tmp_path):
    job = train_in_process(tmp_path, "--auto-augment", "ra", "--ra-magnitude", "5",
                           "--crop-min-scale", "0.35", "--train-crop", "shorter-side",
                           "--train-crop-size", "48", "--val-resize-size", "40",
                           "--val-crop-size", "36", "--decoder", "pillow", "-j", "0",
                           "--run-name", "augment")
    precision = Precision.from_config("off", False, "cpu")
    train, val = build_pipelines(job, WorkerEnv(), precision)
    try:
        assert train.loader.dataset.recipe == TrainRecipe(48, auto_augment="ra",
                                                          ra_magnitude=5, scale=(0.35, 1.0),
                                                          crop="shorter-side")
        assert val.loader.dataset.recipe == EvalRecipe(36, 36 / 40)
        assert next(train.epoch(0)).images.shape[-2:] == (48, 48)
        assert next(val.epoch(0)).images.shape[-2:] == (36, 36)
    finally:
        train.close()
        val.close()


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_trains_on_cpu_with_a_tiny_override(tmp_path, path):
    """Each config's own recipe (augmentations, sampler, schedule) for an epoch of 2 classes,
    with the model, sizes and batch made small: no config rots."""
    recipe = tomllib.loads(path.read_text())
    progressive = "progressive_start_size" in recipe.get("data", {})
    size = (("--progressive-start-size", "32", "--progressive-end-size", "32") if progressive
            else ("--train-crop-size", "32"))
    job = train_in_process(tmp_path, "--config", str(path), "--classes", "2", "--epochs", "1",
                           *size, "--val-crop-size", "32", "--val-resize-size", "36", "-b", "8",
                           "--run-name", path.stem)
    metrics = train_worker(job, WorkerEnv(), LocalSync(), NullLogger()).metrics
    assert metrics["epoch"] == 1 and metrics["train/images"] > 0
    assert metrics["val/images"] == 20 and metrics["train/image_size"] == 32
    assert ("val_ema/top1" in metrics) == recipe.get("train", {}).get("model_ema", False)


def test_bce_loss_trains_a_mixed_batch_as_timm_would_without_host_syncs(tmp_path):
    """--bce-loss with mixup and label smoothing: the step's loss is timm's BinaryCrossEntropy
    on timm's Mixup targets (smoothed rows, mixed), and the step never asks the host."""
    job = train_in_process(tmp_path, "--epochs", "1", "--run-name", "bce", "--classes", "5",
                           "--mixup-alpha", "1.0", "--label-smoothing", "0.1", "--bce-loss",
                           "--drop-path", "0.1", "--model-kwargs", "aa_layer=blurpool",
                           "--amp", "off")  # fp32, as `expected` is computed
    trainer = Trainer(job, WorkerEnv(), LocalSync())
    try:
        batches, batch, inputs, lam, model = first_mixed_step(trainer)
        torch.manual_seed(1)  # drop-path draws: the same for the copy and the step
        logits = model(inputs).double()
        rows = F.one_hot(batch.labels, 5).double() * (1 - 0.1) + 0.1 / 5
        target = lam * rows + (1 - lam) * rows.roll(1, 0)
        expected = timm.loss.BinaryCrossEntropy(target_threshold=None)(logits, target)
        torch.manual_seed(1)
        with HostSyncs() as syncs:
            loss = trainer.train_step(batch)
        assert syncs.calls == []
        assert torch.allclose(loss.double(), expected, rtol=1e-5, atol=0)
    finally:
        trainer.close()


def test_resume_with_drop_path_and_bce_continues_exactly(tmp_path):
    """Drop-path draws from torch's generator, whose state the checkpoint keeps."""
    a, b = straight_and_resumed(tmp_path, 2, 10, "--drop-path", "0.2", "--bce-loss",
                                "--mixup-alpha", "0.5", "--label-smoothing", "0.1")
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


def test_gradient_clipping_bounds_the_first_update_without_a_host_sync(tmp_path):
    """SGD's first step moves each weight by lr x clipped grad (no momentum history, no weight
    decay): the update's norm is lr x the clip."""
    job = train_in_process(tmp_path, "--epochs", "1", "--classes", "5", "--wd", "0",
                           "--warmup-epochs", "0", "--clip-grad-norm", "1e-3",
                           "--run-name", "clip")
    trainer = Trainer(job, WorkerEnv(), LocalSync())
    try:
        params = list(trainer.model.parameters())
        before = [p.detach().clone() for p in params]
        lr = trainer.optimizer.param_groups[0]["lr"]
        batch = next(trainer.train_data.epoch(0))
        with HostSyncs() as syncs:
            trainer.train_step(batch)
        assert syncs.calls == []
        moved = sum(float(((p.detach() - b).double() ** 2).sum()) for p, b in zip(params, before))
        assert moved ** 0.5 == pytest.approx(lr * 1e-3, rel=1e-3)
    finally:
        trainer.close()

"""The weights' moving average: torchvision's update rule, its place in the run's state, and
its evaluation beside the raw weights."""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from app.config.sources import parse_config
from app.loggers import NullLogger
from app.parallel.sync import LocalSync, checked_parameters, compare_checksums, weights_checksum
from app.parallel.watch import SyncFailure
from app.runtime.devices import WorkerEnv
from app.runtime.errors import UserError
from app.training import checkpoint
from app.training.ema import ModelEma, adjusted_decay
from app.training.trainer import Trainer, train_worker
from conftest import TINY_TRAIN_FLAGS, run_driver
from training import CATALOG, HostSyncs, straight_and_resumed, train_in_process


def test_decay_is_adjusted_for_the_update_interval_batch_and_epochs_as_torchvision_does():
    # torchvision's resnet50 recipe: 8 x 128 images a step, every 32 steps, 600 epochs
    assert adjusted_decay(0.99998, 1024, 32, 600) == pytest.approx(1 - 2e-5 * 1024 * 32 / 600)
    assert adjusted_decay(0.9, 4096, 32, 10) == 0.0  # alpha is capped at 1: a plain copy


def batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()


def train_a_little(model: nn.Module) -> None:
    """Moves the weights and the BatchNorm statistics (and its batch counter)."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    model.train()(torch.randn(8, 3, dtype=torch.float64))


def state_of(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_every_nth_step_averages_weights_and_statistics_and_copies_counters():
    model = batchnorm_model()
    ema = ModelEma(model, decay=0.75, every=2)
    expected = None
    for step in range(1, 8):
        train_a_little(model)
        ema.after_step(epoch_step=step - 1, step=step)
        if (step - 1) % 2 == 0:  # steps 1, 3, 5, 7: their epoch indices 0, 2, 4, 6
            current = state_of(model)
            expected = current if expected is None else {
                k: 0.75 * expected[k] + 0.25 * v if v.is_floating_point() else v
                for k, v in current.items()}
        averaged = ema.module.state_dict()
        for key, value in expected.items():
            torch.testing.assert_close(averaged[key], value, rtol=1e-12, atol=1e-12)
    assert ema.updates == 4
    assert averaged["1.num_batches_tracked"] == 7  # copied, not averaged
    assert not torch.equal(averaged["0.weight"], model.state_dict()["0.weight"])


def test_updates_during_the_warmup_copy_the_weights_then_averaging_starts():
    model = batchnorm_model()
    ema = ModelEma(model, decay=0.5, every=1, warmup_steps=3)
    for step in range(1, 5):  # steps 1-3 are the warmup; step 4's update copies (count 0)
        train_a_little(model)
        ema.after_step(step - 1, step)
        for key, value in model.state_dict().items():
            assert torch.equal(ema.module.state_dict()[key], value), (step, key)
    before = state_of(ema.module)
    train_a_little(model)
    ema.after_step(4, 5)
    torch.testing.assert_close(ema.module.state_dict()["0.weight"],
                               (before["0.weight"] + model.state_dict()["0.weight"]) / 2)


def test_an_update_never_waits_for_the_device():
    model = batchnorm_model()
    ema = ModelEma(model, decay=0.9)
    with HostSyncs() as syncs:
        for step in range(1, 4):
            ema.after_step(step - 1, step)
    assert syncs.calls == [] and ema.updates == 3


def test_replica_checks_compare_the_averages_weights_too():
    model = batchnorm_model()
    ema = ModelEma(model, decay=0.9)
    checked = checked_parameters(model, ema.module)
    names = [name for name, _ in checked]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias",
                     "ema.0.weight", "ema.0.bias", "ema.1.weight", "ema.1.bias"]
    same = weights_checksum([t for _, t in checked])
    with torch.no_grad():
        ema.module[0].bias[0] += 1e-3  # only the average drifted
    drifted = weights_checksum([t for _, t in checked])
    with pytest.raises(SyncFailure, match=r"first: ema\.0\.bias"):
        compare_checksums(7, [same, drifted], names)


def test_best_pt_follows_the_better_of_the_raw_and_the_average(caplog):
    trainer = SimpleNamespace(env=WorkerEnv(), best_top1=0.5, position=SimpleNamespace(epoch=3))
    with caplog.at_level(logging.INFO, logger="imagenet_dp"):
        assert Trainer.best_of(trainer, {"val/top1": 0.6, "val_ema/top1": 0.7}) == 0.7
    assert "EMA weights rate best (top-1 0.7000, raw 0.6000)" in caplog.text
    assert Trainer.best_of(trainer, {"val/top1": 0.6, "val_ema/top1": 0.4}) == 0.6
    assert Trainer.best_of(trainer, {"val/top1": 0.6}) == 0.6


EMA_FLAGS = ("--model-ema", "--model-ema-steps", "3", "--model-ema-decay", "0.995")


@pytest.mark.parametrize("optimizer", ["lamb", "lars", "ranger"])
def test_resume_with_the_average_lamb_lars_or_ranger_and_clipping_continues_exactly(
        tmp_path, optimizer):
    a, b = straight_and_resumed(tmp_path, 2, 10, *EMA_FLAGS, "--optimizer", optimizer,
                                "--lr", "0.01", "--clip-grad-norm", "1.0")
    # updates after epoch steps 0, 3, 6, 9 of each epoch; the two within the warmup's first 5
    # steps (--warmup-epochs 0.5) reset the count
    assert a["ema"]["updates"] == b["ema"]["updates"] == 6
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
        assert torch.equal(a["ema"]["model"][key], b["ema"]["model"][key]), key
    # LARS: momentum; LAMB: two moments; Ranger: RAdam's two moments and Lookahead's slow
    # weights, taken at step 6 and resumed at step 10, between two pulls (every 6 steps)
    for key, state in a["optimizer"]["state"].items():
        assert state.keys() == b["optimizer"]["state"][key].keys()
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][key][name]), (key, name)
    if optimizer == "ranger":
        assert all("lookahead_slow_buff" in state for state in a["optimizer"]["state"].values())
        assert [g["lookahead_step"] for g in b["optimizer"]["param_groups"]] == [20, 20]
    assert not torch.equal(a["ema"]["model"]["fc.weight"], a["model"]["fc.weight"])


class Recorder(NullLogger):
    def __init__(self):
        self.epochs = []

    def log_metrics(self, step, metrics):
        if "val/top1" in metrics:
            self.epochs.append(metrics)


def test_evaluate_with_use_ema_rates_the_checkpoints_average(tmp_path):
    job = train_in_process(tmp_path, "--epochs", "2", *EMA_FLAGS, "--run-name", "ema")
    recorder = Recorder()
    train_worker(job, WorkerEnv(), LocalSync(), recorder)
    assert [r["epoch"] for r in recorder.epochs] == [1, 2]
    assert all(0 <= r["val_ema/top1"] <= r["val_ema/top5"] <= 1 for r in recorder.epochs)
    last_epoch = recorder.epochs[-1]
    assert last_epoch["val/top1"] != last_epoch["val_ema/top1"]  # else the test shows nothing
    last = str(tmp_path / "ema" / "checkpoints" / "last.pt")

    def evaluated(*flags) -> dict:
        again = train_in_process(tmp_path, "-e", "--resume", last, *flags)
        return train_worker(again, WorkerEnv(), LocalSync(), NullLogger()).metrics
    assert evaluated("--use-ema")["val/top1"] == last_epoch["val_ema/top1"]
    assert evaluated()["val/top1"] == last_epoch["val/top1"]
    saved = checkpoint.load(last)
    best = checkpoint.load(tmp_path / "ema" / "checkpoints" / "best.pt")
    assert best["best_top1"] == max(max(r["val/top1"], r["val_ema/top1"])
                                    for r in recorder.epochs)
    assert saved["ema"]["updates"] > 0


def test_use_ema_on_a_checkpoint_without_an_average_is_a_one_line_error(tmp_path):
    job = train_in_process(tmp_path, "--epochs", "1", "--classes", "5", "--run-name", "plain")
    train_worker(job, WorkerEnv(), LocalSync(), NullLogger())
    last = tmp_path / "plain" / "checkpoints" / "last.pt"
    result = run_driver(*CATALOG, *TINY_TRAIN_FLAGS, "--classes", "5", "-e", "--resume",
                        str(last), "--use-ema", cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {last} has no EMA weights (it was trained without --model-ema); evaluate it "
        "without --use-ema")


def test_use_ema_without_evaluate_is_refused():
    with pytest.raises(UserError, match="--use-ema selects the weights -e evaluates"):
        parse_config(["--use-ema"])
    assert parse_config(["-e", "--use-ema"])[0].run.use_ema

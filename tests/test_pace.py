"""The loop's clock (app/training/pace.py): the share of each print interval and epoch spent
waiting for batches, the time left, and the warning an input-bound epoch gives. A fake clock
makes the shares exact: batches that take W seconds to come and steps that take S give a
wait share of W / (W + S)."""

import pytest

from app.parallel.sync import LocalSync
from app.runtime.devices import WorkerEnv
from app.training import pace as pace_module
from app.training.pace import Pace
from app.training.trainer import Trainer
from training import train_in_process


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(pace_module, "time", clock)
    return clock


def slow(items, clock, seconds):
    """`items`, each taking `seconds` to come."""
    for item in items:
        clock.now += seconds
        yield item


def test_the_wait_share_of_each_interval_and_epoch(clock):
    pace = Pace()
    pace.start_epoch()
    shares = []
    for step, _ in enumerate(pace.batches(slow(range(6), clock, 3.0)), start=1):
        clock.now += 1.0  # the step
        if step % 2 == 0:
            shares.append(pace.end_interval())
    assert [(i.seconds, i.data_wait) for i in shares] == [(8.0, 0.75)] * 3
    assert [i.epoch_seconds for i in shares] == [8.0, 16.0, 24.0]
    assert pace.epoch_data_wait() == 0.75
    clock.now += 6.0  # evaluation and saving: part of the epoch, not of its data wait
    assert pace.epoch_data_wait() == 18.0 / 30.0  # asked before the evaluation, as the loop does
    assert pace.end_epoch(whole=True) == 30.0


def test_the_time_left_is_epochs_left_times_the_mean_whole_epoch(clock):
    pace = Pace()
    for seconds, whole in [(50.0, False), (30.0, True), (40.0, True)]:
        pace.start_epoch()
        assert pace.remaining_s(5) is None or whole
        clock.now += seconds
        pace.end_epoch(whole)
    assert pace.remaining_s(4) == 4 * 35.0  # the resumed, partial epoch does not count
    assert pace.remaining_s(0) == 0.0


@pytest.mark.parametrize("wait, step, warned", [(1.0, 1.0, True), (1.0, 19.0, False)])
def test_an_epoch_that_waits_for_batches_says_so_and_names_the_knobs(tmp_path, clock, caplog,
                                                                       wait, step, warned):
    job = train_in_process(tmp_path, "--epochs", "1", "-p", "5", "--run-name", "pace")
    trainer = Trainer(job, WorkerEnv(), LocalSync())
    pipeline_epoch, train_step = trainer.train_data.epoch, trainer.train_step

    def slow_epoch(epoch, start_step=0):
        return slow(pipeline_epoch(epoch, start_step), clock, wait)

    def timed_step(*args):
        clock.now += step
        return train_step(*args)
    trainer.train_data.epoch, trainer.train_step = slow_epoch, timed_step
    logged = []
    trainer.logger.log_metrics = lambda step, metrics: logged.append(metrics)
    try:
        with caplog.at_level("WARNING", logger="imagenet_dp"):
            trainer.fit()
    finally:
        trainer.close()
    share = wait / (wait + step)
    intervals = [m for m in logged if "train/data_wait" in m]
    assert [m["train/data_wait"] for m in intervals] == pytest.approx([share] * 2)
    epoch = next(m for m in logged if "val/top1" in m)
    assert epoch["epoch/data_wait"] == pytest.approx(share)
    assert ("epoch 1: waited for batches 50% of its training time (input-bound)" in caplog.text
            ) == warned
    if warned:
        assert "-j, now 0" in caplog.text and "--decoder, now pillow" in caplog.text
        assert "cache_dir in datasets.toml" in caplog.text

"""TensorBoard beside metrics.jsonl: a real run's event files, read back with tensorboard's own
reader, hold every number of metrics.jsonl under the same name and step; one writer however
many workers; beside wandb; from the Python API; a resumed session's steps replace the old
ones; only the process that logs imports tensorboard."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import app
from app.config import Config
from app.config.sources import parse_config
from app.loggers.base import RunInfo
from app.loggers.objects import TensorBoard, start_loggers
from app.loggers.tensorboard_logger import TensorBoardLogger
from app.runtime import moments
from app.runtime.errors import UserError
from conftest import REPO, TINY_TRAIN_FLAGS, run_driver

pytest.importorskip("tensorboard")  # machines that train without it (gpu-check) skip these
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator)

WITH_WANDB = importlib.util.find_spec("wandb") is not None


def event_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)], as TensorBoard reads the folder (every event file in it)."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def event_text(log_dir: Path, tag: str) -> str:
    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors(f"{tag}/text_summary")
    return text.tensor_proto.string_val[0].decode()


def series(records: list[dict], step_key: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every number in the records but their step and timestamps
    (null in metrics.jsonl is a NaN: JSON has none)."""
    found: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        step = record[step_key]
        for name, value in record.items():
            if name in (step_key, "time") or name.startswith("_"):
                continue
            if value is None or isinstance(value, (int, float)):
                found.setdefault(name, []).append((step, float("nan") if value is None
                                                   else value))
    return found


def jsonl_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return series([json.loads(line) for line in lines], "step")


def assert_same_series(found: dict, expected: dict) -> None:
    """The same tags, steps and values (TensorBoard keeps scalars as float32)."""
    assert sorted(found) == sorted(expected)
    for tag, points in expected.items():
        assert [step for step, _ in found[tag]] == [step for step, _ in points], tag
        assert [value for _, value in found[tag]] == pytest.approx(
            [value for _, value in points], rel=1e-6, nan_ok=True), tag


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Two workers train one epoch with console and tensorboard (and wandb offline, where it is
    installed); each process records what it imported at its moments."""
    cwd = tmp_path_factory.mktemp("tensorboard")
    imports = cwd / "imports"
    imports.mkdir()
    loggers = "console,tensorboard,wandb" if WITH_WANDB else "console,tensorboard"
    result = run_driver("--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny",
                        *TINY_TRAIN_FLAGS, "--devices", "cpu,cpu", "--sync", "ps", "-b", "16",
                        "--epochs", "1", "-p", "4", "--run-name", "tb", "--logger", loggers,
                        cwd=cwd, env={"WANDB_DIR": str(cwd), "WANDB_MODE": "offline",
                                      moments.IMPORTS_DIR: str(imports)},
                        separate=True)  # a driver process of its own: its imports are the test's
    assert result.returncode == 0, result.stderr
    return cwd, cwd / "runs" / "tb"


def test_the_event_files_hold_every_number_of_metrics_jsonl(two_workers):
    _, run_dir = two_workers
    found = event_scalars(run_dir / "tensorboard")
    expected = jsonl_series(run_dir)
    # 320 images / (2 x 16) = 10 steps; -p 4: steps 4, 8, 10, then the epoch's record at 10
    assert expected["train/loss"][0][0] == 4 and [s for s, _ in expected["val/top1"]] == [10]
    assert_same_series(found, expected)
    assert '"arch": "test_resnet"' in event_text(run_dir / "tensorboard", "config")


def test_two_workers_write_one_event_file_and_only_the_primary_imports_tensorboard(
        two_workers):
    cwd, run_dir = two_workers
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    processes: dict[str, dict[str, set[str]]] = {}  # pid -> moment -> packages imported by then
    for path in (cwd / "imports").glob("*.imports"):
        moment, pid, _ = path.name.rsplit(".", 2)
        processes.setdefault(pid, {})[moment] = set(path.read_text().split())
    assert len(processes) == 4  # the driver, the parameter server, two workers
    importers = [moments for moments in processes.values()
                 if any("tensorboard" in packages for packages in moments.values())]
    assert len(importers) == 1 and "worker:end" in importers[0]
    assert "tensorboard" not in importers[0]["worker:start"]  # its logger imported it


def one_point_per_step(found: dict[str, list[tuple[int, float]]]) -> dict[str, list]:
    """The last value at each step: wandb merges the records logged at one step into one row."""
    return {tag: sorted(dict(points).items()) for tag, points in found.items()}


def test_tensorboard_and_wandb_record_the_same_numbers_of_one_run(two_workers):
    pytest.importorskip("wandb")
    from wandb_records import history, read_records  # noqa: PLC0415 (needs wandb)
    cwd, run_dir = two_workers
    (wandb_file,) = (cwd / "wandb").glob("offline-run-*/*.wandb")
    from_wandb = one_point_per_step(series(history(read_records(wandb_file)), "_step"))
    assert [step for step, _ in from_wandb["val/top1"]] == [10]
    assert_same_series(one_point_per_step(event_scalars(run_dir / "tensorboard")), from_wandb)


def test_the_python_api_logs_to_tensorboard_inside_logging_to(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    tiny = app.open_catalog(REPO / "datasets.toml").dataset("sample_tiny")
    setup = app.prepare_training(
        model, tiny.solutions("LOC_train_solution.csv"), devices=["cpu"],
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), batch_size=32, epochs=1,
        image_size=32, workers=0, print_freq=2, output_dir=str(tmp_path), run_name="api")
    with app.logging_to(app.loggers.TensorBoard()):
        history = app.train(setup, loss=nn.CrossEntropyLoss())
    run_dir = Path(setup.run_dir)
    found = event_scalars(run_dir / "tensorboard")
    assert found["val/top1"][0][1] == pytest.approx(history["val_top1"][0])
    assert_same_series(found, jsonl_series(run_dir))


def test_an_epochs_record_is_on_disk_before_the_run_ends(tmp_path):
    """A run killed later keeps its finished epochs: the writer flushes at each epoch's end."""
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics(4, {"epoch": 1, "train/loss": 2.5})
    logger.log_metrics(10, {"epoch": 1, "val/top1": 0.25, "val/loss": 2.0})
    assert event_scalars(tmp_path)["val/top1"] == [(10, 0.25)]
    assert event_scalars(tmp_path)["train/loss"] == [(4, 2.5)]
    logger.finish()


def test_a_resumed_session_replaces_the_steps_it_logs_again(tmp_path):
    first = TensorBoardLogger(tmp_path)
    for step in (4, 8, 10):
        first.log_metrics(step, {"train/loss": float(step)})
    first.finish()
    resumed = TensorBoardLogger(tmp_path)  # from a checkpoint at step 4: 8 and 10 again
    for step in (8, 10):
        resumed.log_metrics(step, {"train/loss": -float(step)})
    resumed.finish()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert event_scalars(tmp_path)["train/loss"] == [(4, 4.0), (8, -8.0), (10, -10.0)]


def test_tensorboard_is_chosen_from_a_config_file_and_a_misspelling_names_the_choices(
        tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[logging]\nloggers = ["console", "tensorboard"]\n')
    assert parse_config(["--config", str(path)])[0].logging.loggers == ["console", "tensorboard"]
    path.write_text('[logging]\nloggers = ["tensorbord"]\n')
    with pytest.raises(UserError, match=r"must be one of console, tensorboard, wandb, got "
                                        r"'tensorbord'$"):
        parse_config(["--config", str(path)])


def test_without_the_package_the_error_is_one_line_saying_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(UserError) as error:
        TensorBoard().start(run_info(tmp_path))
    assert str(error.value) == ("--logger tensorboard: the tensorboard package is not installed "
                                "here; pip install tensorboard, or choose --logger console")


def test_a_name_in_place_of_a_logger_object_lists_the_objects(tmp_path):
    with pytest.raises(UserError, match=r"logger='tensorboard': pass app.loggers.Console\(\), "
                                        r".*TensorBoard\(\), Wandb"):
        start_loggers("tensorboard", run_info(tmp_path))


def run_info(run_dir: Path) -> RunInfo:
    config = Config()
    return RunInfo(name="r", run_id="abcd1234", run_dir=run_dir, epochs=1,
                   config=config.to_dict(), settings=config.logging)

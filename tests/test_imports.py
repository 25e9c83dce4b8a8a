"""What each kind of process of a real run imports (the packages outside the standard library,
recorded at named moments: app/runtime/moments.py), so that no import creeps back into a
process that pays for it: the driver imports no torch, the workers and the parameter server
import nothing after they were forked (the forkserver imported it once for all), the loader
processes nothing beyond their worker's. tests/test_layout.py checks the modules' own import
lines (DALI's reader processes, the spawned fallback of the loaders)."""

from __future__ import annotations

import pytest

from app.runtime import moments
from conftest import REPO, TINY_TRAIN_FLAGS, run_driver

# Seconds each, and never needed by the driver of a CPU run (torch: the workers'; the others:
# their features' own processes)
HEAVY = {"torch", "torchvision", "timm", "wandb", "tensorboard", "matplotlib", "onnx",
         "onnxruntime", "nvidia", "s3fs", "obstore", "boto3", "botocore", "huggingface_hub",
         "sympy", "triton"}
NOT_IN_TRAINING = {"onnx", "onnxruntime", "nvidia", "s3fs", "obstore", "boto3", "botocore"}


@pytest.fixture(scope="module")
def imports(tmp_path_factory) -> dict[str, list[set[str]]]:
    """moment -> the import sets recorded there, one per process, of a 2-worker ps run with a
    loader process per worker, on the local tiny sample."""
    folder = tmp_path_factory.mktemp("imports")
    result = run_driver("--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny",
                        *TINY_TRAIN_FLAGS, "-b", "16", "-j", "1", "--epochs", "1",
                        "--devices", "cpu,cpu", "--sync", "ps", cwd=folder,
                        env={moments.IMPORTS_DIR: str(folder)},
                        separate=True)  # a driver process of its own: its imports are the test's
    assert result.returncode == 0, result.stderr
    found: dict[str, dict[int, set[str]]] = {}
    for path in folder.glob("*.imports"):
        moment, pid, _ = path.name.rsplit(".", 2)
        found.setdefault(moment, {})[int(pid)] = set(path.read_text().split())
    return {moment: [sets[pid] for pid in sorted(sets)] for moment, sets in found.items()}


def test_the_driver_imports_no_torch_nor_any_library_of_the_workers(imports):
    for moment in ("driver:launch", "driver:started", "driver:end"):
        (driver,) = imports[moment]
        assert driver & HEAVY == set(), moment
        assert {"pandas", "app"} <= driver  # it reads the tables itself


def test_workers_and_the_server_import_nothing_after_the_forkserver_forked_them(imports):
    started, first_batch = imports["worker:start"], imports["worker:first-batch"]
    (server,) = imports["server:start"]
    assert len(started) == len(first_batch) == 2
    assert {"torch", "timm", "app"} <= started[0]
    assert started[0] == started[1] == server  # one forkserver's preload
    assert first_batch == started  # model, optimizer, pipelines, sync: all preloaded
    assert imports["server:registered"] == [server]
    assert started[0] & NOT_IN_TRAINING == set()


def test_only_the_primary_worker_imports_the_plotting_library_for_its_curves(imports):
    ended = imports["worker:end"]
    assert sum("matplotlib" in packages for packages in ended) == 1
    assert all(packages & NOT_IN_TRAINING == set() for packages in ended)


def test_no_process_imports_tensorboard_or_wandb_when_the_run_does_not_log_to_them(imports):
    """Their loggers import them, in the primary only (tests/test_tensorboard.py,
    tests/test_logging.py: runs that ask). timm would import wandb wherever it is installed
    (timm/utils/summary.py); app/models/timm_lib.py hides it from that import."""
    everyone = [packages for sets in imports.values() for packages in sets]
    assert len(everyone) > 10
    assert all(packages.isdisjoint({"tensorboard", "wandb"}) for packages in everyone)


def test_loader_processes_import_nothing_beyond_their_worker(imports):
    """They are forked from it when training starts; decoding (Pillow, the recipe's ops) needs
    no package the worker has not imported."""
    worker = imports["worker:first-batch"][0]
    assert len(imports["loader:start"]) == 4  # train and val, one each per worker
    assert all(packages == worker for packages in imports["loader:start"])
    assert all(packages == worker for packages in imports["loader:batch"])

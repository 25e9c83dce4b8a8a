"""Pre-flight checks: the run folder, free space for the kept checkpoints, the listed files."""

import io
import logging
import shutil

import pytest
import torch

from app.config.sources import make_config, parse_config
from app.launch.run import prepare_job
from app.models.factory import create_model
from app.runtime.errors import UserError
from app.training import preflight
from app.training.ema import ModelEma
from app.training.optim import build_optimizer
from conftest import REPO, TINY_TRAIN_FLAGS, run_driver, write_catalog

TINY = ("--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny")


def job_for(tmp_path, *flags):
    config, _ = parse_config([*flags, "--output-dir", str(tmp_path / "runs"),
                              "--run-name", "check"])
    return prepare_job(config)


def test_no_room_for_the_kept_checkpoints_stops_before_training(tmp_path):
    result = run_driver(*TINY, *TINY_TRAIN_FLAGS, "--keep-checkpoints", "1000000000",
                        cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "--keep-checkpoints" in result.stderr and "GiB free" in result.stderr
    assert "Traceback" not in result.stderr
    assert all(not path.read_text() for path in tmp_path.glob("runs/*/metrics.jsonl"))
    assert not list(tmp_path.glob("runs/*/checkpoints/*"))  # nothing trained or saved


def test_unwritable_output_folder_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = run_driver(*TINY, *TINY_TRAIN_FLAGS, "--output-dir", str(blocker / "runs"),
                        cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"cannot write the run folder {blocker}/runs/" in result.stderr
    assert "--output-dir" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("optimizer, ema", [("sgd", False), ("adamw", False), ("lars", False),
                                           ("lamb", False), ("sgd", True)])
def test_checkpoint_size_estimate_matches_a_saved_checkpoint(optimizer, ema):
    config = make_config({("optim", "optimizer"): optimizer})
    model = create_model("resnet18", 10)
    optim = build_optimizer(model, config.optim, global_batch=256)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optim.step()  # creates the optimizer's state tensors
    saved = io.BytesIO()
    average = ModelEma(model, decay=0.9).state_dict() if ema else None
    torch.save({"model": model.state_dict(), "optimizer": optim.state_dict(), "ema": average},
               saved)
    assert preflight.checkpoint_bytes(model, optimizer, ema) == pytest.approx(saved.tell(),
                                                                              rel=0.02)


def test_every_listed_local_file_is_checked(tmp_path, tiny_copy, caplog):
    catalog = write_catalog(tmp_path / "datasets.toml", {"data": {"url": str(tiny_copy)}})
    flags = ("--catalog", str(catalog))
    job = job_for(tmp_path, *flags)
    gone = [job.tables.train.path[7], job.tables.val.path[3]]
    for path in gone:
        (tiny_copy / path).unlink()
    listed = len(job.tables.train) + len(job.tables.val)

    with caplog.at_level(logging.WARNING, logger="imagenet_dp"):
        preflight.check(job_for(tmp_path, *flags), saves=True)  # 2 of 420: within 1%
    assert f"2 of {listed} listed images are missing" in caplog.text
    assert "skipped.tsv" in caplog.text

    with pytest.raises(UserError) as error:
        preflight.check(job_for(tmp_path, *flags, "--max-bad-fraction", "0.001"), saves=True)
    assert f"2 of {listed} listed images are missing (first: {tiny_copy}/{sorted(gone)[0]})" \
        in str(error.value)


def test_remote_datasets_are_checked_by_sampling(tmp_path, s3_server, tiny_copy):
    shutil.rmtree(tiny_copy / "ILSVRC" / "Data" / "CLS-LOC" / "val")  # a quarter of the images
    url = s3_server.upload(tiny_copy, "imagenet-no-val", "ilsvrc")
    catalog = write_catalog(tmp_path / "datasets.toml", {"s3": {
        "url": url, "endpoint_url": s3_server.endpoint, "region": "us-east-1"}})
    job = job_for(tmp_path, "--catalog", str(catalog))
    with pytest.raises(UserError) as error:
        preflight.check(job, saves=True)
    message = str(error.value)
    assert f"of {preflight.REMOTE_SAMPLE} listed images of a random sample are missing" in message
    assert f"{url}/ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_" in message


def test_stale_checkpoint_temporaries_are_removed(tmp_path):
    job = job_for(tmp_path, *TINY)
    job.checkpoint_dir.mkdir(parents=True)
    stale = job.checkpoint_dir / ".step-000000040.pt.12345.tmp"
    stale.write_bytes(b"half a checkpoint")
    kept = job.checkpoint_dir / "last.pt"
    kept.write_bytes(b"stands in for a checkpoint")
    preflight.check(job, saves=False)  # torchrun's other ranks leave the folder alone
    assert stale.exists()
    preflight.check(job, saves=True)
    assert not stale.exists() and kept.exists()


def test_imagefolder_datasets_are_checked_too(tmp_path, tiny_imagefolder, caplog):
    """A file listed when the tables were built and gone by the time the run starts."""
    copy = shutil.copytree(tiny_imagefolder, tmp_path / "folders")
    catalog = write_catalog(tmp_path / "datasets.toml", {"data": {
        "url": str(copy), "layout": "imagefolder"}})
    job = job_for(tmp_path, "--catalog", str(catalog))
    gone = job.tables.val.path[7]
    (copy / gone).unlink()
    with caplog.at_level(logging.WARNING, logger="imagenet_dp"):
        preflight.check(job, saves=True)
    assert f"1 of 420 listed images are missing (first: {copy}/{gone})" in caplog.text

"""--pretrained (app/models/pretrained.py, app/models/saved_weights.py): a new run from saved
weights, keys matched by name and shape, a classifier of another class count re-initialised."""

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from app.config import ModelConfig
from app.config.sources import parse_config
from app.launch.run import prepare_job, write_run_folder
from app.models import pretrained
from app.models.factory import create_model, create_model_from_config
from app.parallel.sync import LocalSync
from app.runtime.devices import WorkerEnv
from app.runtime.errors import UserError
from app.training import checkpoint
from app.training.trainer import Position, Trainer
from conftest import TINY_TRAIN_FLAGS, run_driver
from trained import CATALOG, epoch_records, train_tiny


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A model trained on the tiny sample's 10 classes: (cwd, its last.pt)."""
    cwd = tmp_path_factory.mktemp("pretrained")
    return cwd, train_tiny(cwd) / "checkpoints" / "last.pt"


def test_checkpoints_name_their_classes(source):
    _, path = source
    state = checkpoint.load(path)
    assert len(state["class_names"]) == 10 and state["class_names"][0] == "n01440764"
    assert state["class_words"][0] == "tench, Tinca tinca"


def test_a_five_class_fine_tune_starts_from_the_weights_with_a_fresh_head(source, tmp_path):
    _, path = source
    config, _ = parse_config([*CATALOG, *TINY_TRAIN_FLAGS, "--classes", "5", "--pretrained",
                              str(path), "--output-dir", str(tmp_path), "--run-name", "ft"])
    job = prepare_job(config)
    write_run_folder(job)
    trainer = Trainer(job, WorkerEnv(), LocalSync())
    try:
        weights = checkpoint.unwrap(trainer.model).state_dict()
        saved = checkpoint.load(path)["model"]
        assert weights.keys() == saved.keys()
        for key in weights:
            if not key.startswith("fc."):
                assert torch.equal(weights[key], saved[key]), key
        # the head: the seeded initialisation every worker gets, not a slice of the old one
        torch.manual_seed(config.train.seed)
        fresh = create_model("test_resnet", 5).state_dict()
        assert weights["fc.weight"].shape == (5, saved["fc.weight"].shape[1])
        assert torch.equal(weights["fc.weight"], fresh["fc.weight"])
        assert not torch.equal(weights["fc.weight"], saved["fc.weight"][:5])
        # a new run: epoch 0, an optimizer without state
        assert trainer.position == Position()
        assert trainer.optimizer.state_dict()["state"] == {}
    finally:
        trainer.close()


def test_the_driver_says_once_that_the_head_is_new_and_trains_from_epoch_1(source):
    cwd, path = source
    result = run_driver(*CATALOG, *TINY_TRAIN_FLAGS, "--classes", "5", "--epochs", "1",
                        "--pretrained", str(path), "--run-name", "ft", cwd=cwd)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "re-initialised" in line]
    assert lines == [f"INFO: --pretrained {path}: fc re-initialised for 5 classes (the "
                     "weights have 10); 90 other tensors loaded"]
    records = epoch_records(cwd / "runs" / "ft")
    assert [r["epoch"] for r in records] == [1]
    state = checkpoint.load(cwd / "runs" / "ft" / "checkpoints" / "last.pt")
    assert (state["epoch"], state["step"], state["num_classes"]) == (1, 5, 5)


def test_a_resumed_fine_tune_reads_its_checkpoint_not_the_pretrained_weights(source, tmp_path):
    """The weights came from --pretrained once; a resumed run has them in its checkpoint, so
    the source is neither read again nor needed (here it is gone)."""
    _, path = source
    copy = tmp_path / "weights.pt"
    copy.write_bytes(path.read_bytes())
    flags = (*CATALOG, *TINY_TRAIN_FLAGS, "--classes", "5", "--pretrained", str(copy),
             "--run-name", "ft")
    first = run_driver(*flags, "--epochs", "1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    copy.unlink()
    resumed = run_driver(*flags, "--epochs", "2", "--resume", "auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "re-initialised" not in resumed.stderr
    assert [r["epoch"] for r in epoch_records(tmp_path / "runs" / "ft")] == [1, 2]


def test_a_torchvision_resnet18_state_dict_loads_with_every_key(tmp_path):
    torch.manual_seed(0)
    reference = torchvision.models.resnet18().eval()
    torch.save(reference.state_dict(), tmp_path / "resnet18.pth")
    save_file(reference.state_dict(), tmp_path / "resnet18.safetensors")
    images = torch.randn(2, 3, 64, 64)
    for source in (str(tmp_path / "resnet18.pth"), f"file://{tmp_path}/resnet18.safetensors"):
        model = create_model_from_config(ModelConfig(arch="resnet18", pretrained=source), 1000)
        found = pretrained.match(create_model("resnet18", 1000).state_dict(),
                                 reference.state_dict(), ("fc.",), source)
        assert found.fresh == () and len(found.loaded) == len(reference.state_dict())
        torch.testing.assert_close(model.eval()(images), reference(images), rtol=0, atol=1e-5)


def test_a_timm_train_checkpoint_with_wrapper_prefixes_loads(tmp_path):
    torch.manual_seed(0)
    model = create_model("test_resnet", 10)
    wrapped = {f"module.{key}": value for key, value in model.state_dict().items()}
    torch.save({"state_dict": wrapped, "epoch": 3}, tmp_path / "train.pth.tar")
    loaded = create_model_from_config(
        ModelConfig(arch="test_resnet", pretrained=str(tmp_path / "train.pth.tar")), 10)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_weights_of_another_model_stop_the_driver_naming_the_first_key(source):
    cwd, path = source
    result = run_driver(*CATALOG, *TINY_TRAIN_FLAGS, "-a", "resnet18", "--pretrained",
                        str(path), "--run-name", "wrong", cwd=cwd)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --pretrained {path} (test_resnet): it has no conv1.weight (the first key of "
        "this model it lacks); check --arch")
    assert "Traceback" not in result.stderr and not (cwd / "runs" / "wrong").exists()


@pytest.mark.parametrize("change, fragment", [
    (lambda state: {**state, "extra.weight": torch.zeros(1)}, "extra.weight is not a key"),
    (lambda state: {**state, "bn1.weight": torch.zeros(3)}, r"bn1.weight has shape \[3\] there"),
])
def test_any_other_mismatch_is_one_line_naming_the_key(tmp_path, change, fragment):
    state = create_model("resnet18", 10).state_dict()
    torch.save(change(state), tmp_path / "w.pth")
    with pytest.raises(UserError, match=fragment):
        create_model_from_config(ModelConfig(arch="resnet18", pretrained=str(tmp_path / "w.pth")),
                                 10)


@pytest.mark.parametrize("content, fragment", [
    (None, "not found"), (b"not torch", "not a PyTorch weights file"),
    (b"\x00" * 16, "not a PyTorch weights file")])
def test_missing_or_foreign_files_are_one_line(tmp_path, content, fragment):
    path = tmp_path / "w.pth"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=fragment):
        create_model_from_config(ModelConfig(arch="resnet18", pretrained=str(path)), 10)


def test_evaluating_on_other_classes_is_refused_and_training_warned(source, tiny_sample):
    _, path = source
    wnids = list(reversed(checkpoint.load(path)["class_names"]))
    model = create_model("test_resnet", 10)
    with pytest.raises(UserError, match="its class 0 is n01440764, the dataset's is"):
        pretrained.check(model, str(path), wnids, True, print)
    warning = pretrained.check(model, str(path), wnids, False, print)
    assert warning and "its classifier is kept" in warning
    assert pretrained.check(model, str(path), wnids[::-1], True, print) is None


def test_weights_at_an_s3_url_load_as_from_the_file(source, s3_server, monkeypatch):
    """Any fsspec URL: here a real S3 endpoint (moto_server), read through
    app/catalog/storage.py."""
    _, path = source
    client = s3_server.client()
    client.create_bucket(Bucket="weights")
    client.put_object(Bucket="weights", Key="runs/last.pt", Body=path.read_bytes())
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)  # botocore's, s3fs follows it
    model = create_model_from_config(
        ModelConfig(arch="test_resnet", pretrained="s3://weights/runs/last.pt"), 10)
    saved = checkpoint.load(path)["model"]
    assert all(torch.equal(model.state_dict()[key], saved[key]) for key in saved)
    with pytest.raises(UserError, match="s3://weights/runs/nope.pt not found"):
        create_model_from_config(
            ModelConfig(arch="test_resnet", pretrained="s3://weights/runs/nope.pt"), 10)

"""bin/export.py (app/inference/export.py): a checkpoint -> model.safetensors + config.json in
timm's local-dir form, and model.onnx, checked by the real clients: timm.create_model("local-dir:")
and an onnxruntime InferenceSession."""

import json

import numpy as np
import onnxruntime
import pytest
import timm
import torch
from safetensors.torch import load_file

from app.catalog.storage import DatasetRoot
from app.catalog.tables import load_tables
from app.data.augment import IMAGENET_MEAN, IMAGENET_STD, EvalRecipe
from app.inference.export import export
from app.inference.model_files import open_model
from app.inference.predict import Transform
from app.models.factory import create_model
from app.runtime.errors import UserError
from app.training import checkpoint
from conftest import run_tool
from trained import CATALOG, epoch_records, train_tiny

CROP_FRACTION = 32 / 37  # the tiny runs' val transform: resize 37, crop 32


def run_export(*args, cwd):
    return run_tool("export.py", *args, cwd=cwd)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run folder, its last.pt, the export of last.pt with model.onnx)."""
    cwd = tmp_path_factory.mktemp("export")
    run = train_tiny(cwd, "source", 2, "--model-ema", "--model-ema-steps", "1")
    last = run / "checkpoints" / "last.pt"
    result = run_export(last, "exported", "--onnx", cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"wrote exported/{name}" for name in
                                          ("model.safetensors", "config.json", "model.onnx")]
    return run, last, cwd / "exported"


@pytest.fixture(scope="module")
def val_images(tiny_sample):
    """The tiny sample's 100 val images as the evaluation feeds them, and their labels."""
    val = load_tables(DatasetRoot("sample_tiny", str(tiny_sample))).val
    transform = Transform(EvalRecipe(32, CROP_FRACTION), IMAGENET_MEAN, IMAGENET_STD)
    images = torch.stack([transform((tiny_sample / path).read_bytes()) for path in val.path])
    return images, torch.tensor(val.label.to_numpy())


def plain_timm_model(last):
    """Our checkpoint in a plain timm model, as the README says it loads."""
    model = timm.create_model("test_resnet", num_classes=10)
    model.load_state_dict(checkpoint.load(last)["model"])
    return model.eval()


def test_config_json_has_timms_fields_and_the_class_names(trained):
    _, last, out = trained
    config = json.loads((out / "config.json").read_text())
    saved = checkpoint.load(last)
    assert (config["architecture"], config["num_classes"]) == ("test_resnet", 10)
    assert config["label_names"] == saved["class_names"]
    assert config["label_descriptions"]["n01440764"] == "tench, Tinca tinca"
    pretrained = config["pretrained_cfg"]
    assert pretrained["input_size"] == [3, 32, 32]
    assert pretrained["crop_pct"] == pytest.approx(CROP_FRACTION)
    assert pretrained["interpolation"] == "bilinear"
    assert (pretrained["mean"], pretrained["std"]) == (list(IMAGENET_MEAN), list(IMAGENET_STD))
    weights = load_file(out / "model.safetensors")
    assert weights.keys() == saved["model"].keys()
    assert all(torch.equal(weights[k], saved["model"][k]) for k in weights)


def test_timm_loads_the_export_and_gives_our_logits(trained, val_images):
    _, last, out = trained
    theirs = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    images = val_images[0][:16]
    with torch.no_grad():
        torch.testing.assert_close(theirs(images), plain_timm_model(last)(images),
                                   rtol=0, atol=1e-5)
    assert theirs.pretrained_cfg["label_names"] == checkpoint.load(last)["class_names"]
    data = timm.data.resolve_data_config({}, model=theirs)
    assert tuple(data["input_size"]) == (3, 32, 32)
    assert data["crop_pct"] == pytest.approx(CROP_FRACTION)


def test_onnx_runtime_matches_our_logits_and_the_drivers_top1(trained, val_images):
    run, last, out = trained
    session = onnxruntime.InferenceSession(str(out / "model.onnx"),
                                           providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", 3, 32, 32]
    images, labels = val_images
    # two batch sizes other than the traced one: the batch dimension is dynamic
    logits = np.concatenate([session.run(["logits"], {"input": part.numpy()})[0]
                             for part in (images[:37], images[37:])])
    with torch.no_grad():
        ours = plain_timm_model(last)(images).numpy()
    np.testing.assert_allclose(logits, ours, rtol=0, atol=1e-4)
    correct = int((torch.from_numpy(logits).argmax(1) == labels).sum())
    evaluated = epoch_records(run)[-1]  # the driver's evaluation of last.pt
    assert evaluated["val/images"] == 100
    assert correct == round(evaluated["val/top1"] * 100)


def test_ema_exports_the_ema_weights(trained, tmp_path):
    _, last, _ = trained
    torch.manual_seed(1)
    ema = create_model("test_resnet", 10).state_dict()
    checkpoint.save(tmp_path / "ema.pt", {**checkpoint.load(last),
                                          "ema": {"model": ema, "updates": 7}})
    export(str(tmp_path / "ema.pt"), tmp_path / "out", ema=True)
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(weights[k], ema[k]) for k in ema)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["imagenet_dp"]["ema"]
    checkpoint.save(tmp_path / "none.pt", {**checkpoint.load(last), "ema": None})
    with pytest.raises(UserError, match="has no EMA weights"):
        export(str(tmp_path / "none.pt"), tmp_path / "none", ema=True)


def test_ema_of_a_checkpoint_without_it_exits_2(trained, tmp_path):
    _, last, _ = trained
    state = checkpoint.load(last)
    del state["ema"]
    checkpoint.save(tmp_path / "plain.pt", state)
    result = run_export(tmp_path / "plain.pt", tmp_path / "out", "--ema", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (f"error: {tmp_path / 'plain.pt'} has no EMA weights (trained "
                             "without --model-ema)\n")
    assert not (tmp_path / "out").exists()


def test_the_ema_export_of_a_run_with_ema_validates_as_the_runs_ema(trained, tmp_path):
    """A real --model-ema run: --ema exports ckpt["ema"]["model"], and validate.py rates it
    as the run rated its EMA (val_ema/*)."""
    run, last, _ = trained
    ema = checkpoint.load(last)["ema"]
    assert ema["updates"] > 0
    export(str(last), tmp_path / "ema", ema=True)
    weights = load_file(tmp_path / "ema" / "model.safetensors")
    assert all(torch.equal(weights[k], ema["model"][k]) for k in ema["model"])
    result = run_tool("validate.py", tmp_path / "ema", *CATALOG, "-j", "0", "--run-name", "v",
                      "--output-dir", tmp_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    evaluated = epoch_records(run)[-1]
    assert evaluated["val_ema/top1"] != evaluated["val/top1"]  # else this proves nothing
    assert f"top-1 {evaluated['val_ema/top1']:.4f}  top-5 {evaluated['val_ema/top5']:.4f}" \
        in result.stdout.splitlines()[-1]


@pytest.mark.parametrize("arch, onnx", [("resnet18_small", False), ("xse_resnext_mini", True)])
def test_the_projects_own_models_export_for_our_tools_and_say_timm_cannot(tmp_path, arch, onnx):
    torch.manual_seed(0)
    model = create_model(arch, 3).eval()
    checkpoint.save(tmp_path / "own.pt", {
        "model": model.state_dict(), "arch": arch, "num_classes": 3,
        "config": {"data": {"image_size": 32}, "model": {"norm": "batch"}}})
    notes = []
    export(str(tmp_path / "own.pt"), tmp_path / "out", onnx=onnx, report=notes.append)
    assert len(notes) == 1 and "timm.create_model cannot rebuild it" in notes[0]
    assert arch in notes[0]
    rebuilt = open_model(str(tmp_path / "out"))
    assert rebuilt.recipe == EvalRecipe(32, 32 / 37) and rebuilt.spec.class_names == ()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = model(images)
        torch.testing.assert_close(rebuilt.model(images), ours, rtol=0, atol=0)
    if onnx:
        session = onnxruntime.InferenceSession(str(tmp_path / "out" / "model.onnx"))
        theirs = session.run(None, {session.get_inputs()[0].name: images.numpy()})[0]
        np.testing.assert_allclose(theirs, ours.numpy(), rtol=1e-4, atol=1e-4)


def test_a_run_normalised_its_own_way_exports_and_validates_that_way(tmp_path):
    """--mean 0,0,0 --std 1,1,1 (pixels in [0, 1]): the export's config.json says so, and
    bin/validate.py feeds the export what training fed the model: the same val loss."""
    run = train_tiny(tmp_path, "unit", 1, "--mean", "0,0,0", "--std", "1,1,1")
    result = run_export(run / "checkpoints" / "last.pt", "exported", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    pretrained = json.loads((tmp_path / "exported" / "config.json").read_text())["pretrained_cfg"]
    assert (pretrained["mean"], pretrained["std"]) == ([0.0] * 3, [1.0] * 3)
    result = run_tool("validate.py", tmp_path / "exported", *CATALOG, "-j", "0", "--run-name",
                      "v", "--output-dir", tmp_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    trained_with, rated = epoch_records(run)[-1], epoch_records(tmp_path / "v")[-1]
    assert rated["val/loss"] == pytest.approx(trained_with["val/loss"], rel=1e-5)
    assert rated["val/top1"] == trained_with["val/top1"]


def test_validate_rates_the_export_as_the_driver_rated_the_checkpoint(trained, tmp_path):
    """bin/validate.py: the driver's evaluation, set up from config.json (classes, sizes)."""
    run, _, out = trained
    result = run_tool("validate.py", out, *CATALOG, "-j", "0", "--run-name", "v",
                      "--output-dir", tmp_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    evaluated = epoch_records(run)[-1]
    assert result.stdout.splitlines()[-1] == (
        f"{out}: top-1 {evaluated['val/top1']:.4f}  top-5 {evaluated['val/top5']:.4f}  "
        f"(100 images, 0 skipped; {tmp_path / 'v' / 'metrics.jsonl'})")

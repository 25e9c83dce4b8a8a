"""bin/predict.py (app/inference/predict.py): the top-k classes of images with their words, from a
checkpoint or an export, with the evaluation's own transform; bad files reported, skipped."""

import io
import json
import shutil

import pytest
import timm
import torch

from app.bench import predict as bench
from app.catalog.storage import DatasetRoot
from app.catalog.tables import load_tables
from app.data.augment import EvalRecipe
from app.data.device import ToDevice
from app.data.pillow_pipeline import build_loader
from app.data.pipeline import InputFormat
from app.data.sampler import ShardedBatches
from app.inference.export import export
from app.inference.predict import run
from app.runtime.errors import UserError
from app.training import checkpoint
from conftest import run_tool
from trained import epoch_records, train_tiny


def run_predict(*args, cwd):
    return run_tool("predict.py", *args, cwd=cwd)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_sample):
    """(cwd, last.pt, the val images the evaluation rates correctly: {path: wnid})."""
    cwd = tmp_path_factory.mktemp("predict")
    run_dir = train_tiny(cwd, "source", 2)
    last = run_dir / "checkpoints" / "last.pt"
    tables = load_tables(DatasetRoot("sample_tiny", str(tiny_sample)))
    model = timm.create_model("test_resnet", num_classes=10)
    model.load_state_dict(checkpoint.load(last)["model"])
    # the evaluation's own pipeline: Pillow loader, then the device's normalisation
    loader = build_loader(DatasetRoot("sample_tiny", str(tiny_sample)), tables.val,
                          EvalRecipe(32, 32 / 37), ShardedBatches(100, 25, shuffle=False), 0)
    to_device = ToDevice(InputFormat(torch.device("cpu")))
    with torch.no_grad():
        right = torch.cat([model.eval()(to_device(b.images, b.labels)[0]).argmax(1) == b.labels
                           for b in loader])
    assert int(right.sum()) == round(epoch_records(run_dir)[-1]["val/top1"] * 100)
    rows = tables.val[right.numpy()]
    correct = {tiny_sample / path: tables.wnids[label]
               for path, label in zip(rows.path, rows.label)}
    assert len(correct) >= 10
    return cwd, last, correct


def test_predict_names_the_class_the_evaluation_got_right_and_skips_a_bad_file(trained):
    cwd, last, correct = trained
    folder = cwd / "images"
    folder.mkdir()
    chosen = dict(list(correct.items())[:12])
    for path in chosen:
        shutil.copy(path, folder / path.name)
    first = next(iter(chosen))
    (folder / "broken.JPEG").write_bytes(first.read_bytes()[:200])  # a truncated JPEG
    (folder / "notes.txt").write_text("not an image: and not picked from a folder")
    result = run_predict(last, folder, "--json", "-k", "3", cwd=cwd)
    assert result.returncode == 1
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {folder / 'broken.JPEG'}: ")
    records = [json.loads(line) for line in result.stdout.splitlines()]
    predicted = {record["image"]: record["top"] for record in records}
    assert set(predicted) == {str(folder / path.name) for path in chosen}
    for path, wnid in chosen.items():
        top = predicted[str(folder / path.name)]
        assert len(top) == 3 and top[0]["class"] == wnid
        assert top[0]["probability"] >= top[1]["probability"] >= top[2]["probability"]
    tench = [t for tops in predicted.values() for t in tops if t["class"] == "n01440764"]
    assert tench and all(t["words"] == "tench, Tinca tinca" for t in tench)


def test_the_export_and_its_onnx_model_predict_what_the_checkpoint_does(trained, tmp_path):
    _, last, correct = trained
    export(str(last), tmp_path / "exported", onnx=True)
    images = [str(path) for path in list(correct)[:8]]

    def classes(model, **options):
        out = io.StringIO()
        assert run(model, images, k=1, as_json=True, out=out, **options) == 0
        return [json.loads(line)["top"][0]["class"] for line in out.getvalue().splitlines()]
    expected = [correct[path] for path in list(correct)[:8]]
    assert classes(str(last)) == expected
    assert classes(str(tmp_path / "exported")) == expected
    assert classes(str(tmp_path / "exported"), onnx=True) == expected
    with pytest.raises(UserError, match="--onnx runs an export's model.onnx"):
        run(str(last), images, onnx=True)
    # bin/bench.py predict: both runtimes on the same images, agreeing
    report = bench.run(str(tmp_path / "exported"), "", 0, images, 4, 1)
    assert [r["runtime"] for r in report["results"]] == ["pytorch", "onnxruntime"]
    assert report["images"] == 8 and report["top1_agreement"] == 1.0
    assert report["max_logit_difference"] < 1e-4
    assert all(r["model_images_per_s"] > 0 and r["e2e_images_per_s"] > 0
               for r in report["results"])


def test_text_output_urls_and_a_missing_file(trained, tmp_path):
    cwd, last, correct = trained
    path, wnid = next(iter(correct.items()))
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(path, folder / "a.JPEG")
    out, err = io.StringIO(), io.StringIO()
    code = run(str(last), [f"file://{folder}", str(tmp_path / "missing.jpg")], k=2, out=out,
               err=err)
    assert code == 1
    assert err.getvalue() == f"error: {tmp_path / 'missing.jpg'}: {tmp_path / 'missing.jpg'} " \
                             "not found\n"
    lines = out.getvalue().splitlines()
    assert lines[0] == f"file://{folder}/a.JPEG" and len(lines) == 3
    words = dict(zip(checkpoint.load(last)["class_names"], checkpoint.load(last)["class_words"]))
    assert lines[1].split()[1] == wnid and lines[1].endswith(f"{wnid}  {words[wnid]}")


def test_an_older_checkpoint_without_class_names_shows_indices_saying_so_once(trained,
                                                                              tmp_path):
    _, last, correct = trained
    state = checkpoint.load(last)
    del state["class_names"], state["class_words"]
    checkpoint.save(tmp_path / "old.pt", state)
    out, err = io.StringIO(), io.StringIO()
    images = [str(path) for path in list(correct)[:3]]
    assert run(str(tmp_path / "old.pt"), images, k=1, as_json=True, out=out, err=err) == 0
    assert err.getvalue().count("holds no class names") == 1
    names = checkpoint.load(last)["class_names"]
    for line, path in zip(out.getvalue().splitlines(), images):
        top = json.loads(line)["top"][0]
        assert top["class"] == str(top["index"]) and names[top["index"]] == correct[
            next(p for p in correct if str(p) == path)]


def test_a_checkpoint_and_an_export_at_an_s3_url_predict_as_the_local_files(
        trained, tmp_path, s3_server, monkeypatch):
    """bin/predict.py and bin/export.py read models from a URL (a real S3 endpoint on
    loopback, through the download cache): the same classes as the local files."""
    _, last, correct = trained
    export(str(last), tmp_path / "exported")
    client = s3_server.client()
    client.create_bucket(Bucket="models")
    client.put_object(Bucket="models", Key="r/last.pt", Body=last.read_bytes())
    for path in (tmp_path / "exported").iterdir():
        client.put_object(Bucket="models", Key=f"r/exported/{path.name}", Body=path.read_bytes())
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("IMAGENET_DP_CACHE", str(tmp_path / "cache"))
    images = [str(path) for path in list(correct)[:4]]

    def classes(model):
        out = io.StringIO()
        assert run(model, images, k=1, as_json=True, out=out) == 0
        return [json.loads(line)["top"][0]["class"] for line in out.getvalue().splitlines()]
    expected = [correct[path] for path in list(correct)[:4]]
    assert classes("s3://models/r/last.pt") == expected
    assert classes("s3://models/r/exported") == expected
    export("s3://models/r/last.pt", tmp_path / "from-url")  # bin/export.py CHECKPOINT_URL OUT
    assert classes(str(tmp_path / "from-url")) == expected

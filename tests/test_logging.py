"""Run outputs: wandb (offline, read back from its own files), metrics.jsonl, curves.png, console."""

import io
import json
import struct

import pytest

from app.loggers.console import ConsoleLogger
from app.loggers.plots import load_metrics
from app.loggers.redact import MASK, redact
from app.training import checkpoint
from conftest import REPO, TINY_TRAIN_FLAGS, run_driver, run_tool

pytest.importorskip("wandb")  # machines that train without it (gpu-check) skip these
from wandb_records import config, history, of_kind, read_records  # noqa: E402

CATALOG = ("--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny")
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"  # planted in the environment


def wandb_run_dirs(wandb_dir):
    return sorted((wandb_dir / "wandb").glob("offline-run-*"))


def jsonl(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def wandb_runs(tmp_path_factory):
    """Two workers log to wandb for 1 epoch; then the run is resumed for a 2nd epoch."""
    cwd = tmp_path_factory.mktemp("wandb")
    env = {"WANDB_DIR": str(cwd), "WANDB_MODE": "offline", "AWS_SECRET_ACCESS_KEY": SECRET,
           "WANDB_API_KEY": SECRET[:40]}
    common = (*CATALOG, *TINY_TRAIN_FLAGS, "--devices", "cpu,cpu", "--sync", "ps", "-b", "16",
              "--run-name", "w", "-p", "4", "--logger", "console,wandb")
    first = run_driver(*common, "--epochs", "1", "--save-weights-every", "1",
                       "--wandb-tags", "smoke,ci", cwd=cwd, env=env)
    assert first.returncode == 0, first.stderr
    after_first = wandb_run_dirs(cwd)
    resumed = run_driver(*common, "--epochs", "2", "--resume", "auto", cwd=cwd, env=env)
    assert resumed.returncode == 0, resumed.stderr
    return cwd, after_first, cwd / "runs" / "w"


def test_wandb_records_the_metrics_and_config_of_one_run(wandb_runs):
    cwd, after_first, run_dir = wandb_runs
    assert len(after_first) == 1  # two workers, one wandb run
    records = read_records(next(after_first[0].glob("*.wandb")))
    rows = history(records)
    epoch_record = [r for r in jsonl(run_dir) if "val/top1" in r][0]
    logged = [r for r in rows if "val/top1" in r]
    assert len(logged) == 1
    assert logged[0]["val/top1"] == pytest.approx(epoch_record["val/top1"])
    assert logged[0]["_step"] == epoch_record["step"]
    train_steps = [r["step"] for r in jsonl(run_dir)[:len(rows)] if "train/loss" in r]
    assert [r["_step"] for r in rows if "train/loss" in r] == train_steps
    logged_config = config(records)
    assert logged_config["model"]["arch"] == "test_resnet"
    assert logged_config["parallel"]["devices"] == ["cpu", "cpu"]
    run = of_kind(records, "run")[0]
    assert list(run.tags) == ["smoke", "ci"] and run.display_name == "w"
    artifacts = of_kind(records, "artifact")
    assert [(a.type, a.name) for a in artifacts] == [("model", f"weights-{run.run_id}")]
    assert "epoch-1" in artifacts[0].aliases


def test_no_secret_reaches_wandb_or_the_run_folder(wandb_runs):
    cwd, _, run_dir = wandb_runs
    files = [p for p in [*cwd.joinpath("wandb").rglob("*"), *run_dir.rglob("*")] if p.is_file()]
    assert len(files) > 10
    leaked = [p for p in files if SECRET.encode() in p.read_bytes()
              or SECRET[:40].encode() in p.read_bytes()]
    assert leaked == []


def test_a_resumed_run_continues_the_same_wandb_run(wandb_runs):
    cwd, after_first, run_dir = wandb_runs
    both = wandb_run_dirs(cwd)
    assert len(both) == 2  # wandb keeps one folder per session of the same run
    ids = {of_kind(read_records(next(d.glob("*.wandb"))), "run")[0].run_id for d in both}
    assert len(ids) == 1
    run_id = ids.pop()
    assert checkpoint.load(run_dir / "checkpoints" / "last.pt")["run_id"] == run_id
    second = history(read_records(next((set(both) - set(after_first)).pop().glob("*.wandb"))))
    first = history(read_records(next(after_first[0].glob("*.wandb"))))
    assert min(r["_step"] for r in second) > max(r["_step"] for r in first)
    assert [r["epoch"] for r in second if "val/top1" in r] == [2]


def test_metrics_jsonl_holds_each_interval_and_epoch_with_growing_steps(wandb_runs):
    _, _, run_dir = wandb_runs
    records = jsonl(run_dir)
    # 320 images / (2 x 16) = 10 steps per epoch; -p 4: steps 4, 8, 10, then the epoch record.
    assert [(r["epoch"], r["step"], "val/top1" in r) for r in records] == [
        (e, base + s, s == 10 and is_epoch) for e, base in ((1, 0), (2, 10))
        for s, is_epoch in ((4, False), (8, False), (10, False), (10, True))]
    assert all(0 < r["train/lr"] for r in records if "train/lr" in r)


def test_curves_png_is_a_valid_png_of_the_run(wandb_runs):
    _, _, run_dir = wandb_runs
    data = (run_dir / "curves.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width > 500 and height > 400


def test_curves_are_redrawn_at_most_every_minute_and_at_the_end(tmp_path, monkeypatch):
    """Epochs shorter than REDRAW_S are drawn once, at the run's end (or at the next epoch's
    end after REDRAW_S); an epoch past it is drawn as it ends."""
    from app.loggers import curves
    metrics, image = tmp_path / "metrics.jsonl", tmp_path / "curves.png"
    epoch = {"epoch": 1, "step": 10, "val/top1": 0.5, "train/loss": 1.0}
    metrics.write_text(json.dumps(epoch) + "\n")
    clock = iter([100.0, 130.0, 170.0])  # started; epoch 1 ends (30 s); epoch 2 ends (70 s)
    monkeypatch.setattr(curves.time, "monotonic", lambda: next(clock, 200.0))
    logger = curves.CurvesLogger(metrics, image)
    logger.log_metrics(10, {"train/loss": 1.0})
    logger.log_metrics(10, epoch)
    assert not image.exists()
    logger.log_metrics(20, {**epoch, "epoch": 2, "step": 20})
    drawn = image.stat().st_mtime_ns
    logger.finish()  # nothing new since epoch 2's draw
    assert image.stat().st_mtime_ns == drawn
    image.unlink()
    fresh = curves.CurvesLogger(metrics, image)
    fresh.log_metrics(10, epoch)
    fresh.finish()
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_compares_runs_and_rejects_a_folder_without_metrics(wandb_runs, tmp_path):
    _, _, run_dir = wandb_runs
    out = tmp_path / "compare.png"
    ok = run_tool("plot.py", run_dir, run_dir, "-o", out, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = run_tool("plot.py", tmp_path, cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"error: cannot read {tmp_path / 'metrics.jsonl'}: No such file or directory; "
        "is this a run folder?"]


def test_load_metrics_keeps_the_latest_records_after_a_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "epoch": 1, "train/loss": float(s)} for s in (4, 8, 10)]
    lines += [{"step": s, "epoch": 1, "train/loss": -float(s)} for s in (8, 10)]  # resumed at 4
    path.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 12, "ep')
    frame = load_metrics(path)
    assert frame["step"].tolist() == [4, 8, 10]
    assert frame["train/loss"].tolist() == [4.0, -8.0, -10.0]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(Exception, match=r"metrics.jsonl:2: not a JSON record"):
        load_metrics(path)


def test_load_metrics_passes_over_restart_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 10, "epoch": 1, "val/top1": 0.5}, {"step": 12, "train/loss": 2.0},
             {"step": 10, "event": "restart", "restart": 1, "cause": "worker 1 was killed"},
             {"step": 11, "train/loss": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    frame = load_metrics(path)
    # The epoch's record at the step the run went on from stays: a restart is no rewind.
    assert frame["step"].tolist() == [10, 11] and "event" not in frame
    assert frame["val/top1"].tolist()[0] == 0.5


def test_redact_masks_secret_names_and_url_credentials():
    config = {"data": {"url": "s3://AKIA1:hunter2@bucket/x?X-Amz-Signature=abc#f",
                       "aws_secret_access_key": "hunter2", "wandb_api_key": "k", "name": "ok"},
              "tags": ["https://u:p@host/x", "plain"], "lr": 0.1, "empty_token": ""}
    assert redact(config) == {
        "data": {"url": f"s3://{MASK}@bucket/x?{MASK}#f", "aws_secret_access_key": MASK,
                 "wandb_api_key": MASK, "name": "ok"},
        "tags": [f"https://{MASK}@host/x", "plain"], "lr": 0.1, "empty_token": ""}


def test_console_prints_progress_with_eta_and_an_epoch_summary():
    stream = io.StringIO()
    console = ConsoleLogger(epochs=3, stream=stream)
    console.log_metrics(8, {"epoch": 2, "train/loss": 1.23456, "train/lr": 0.05,
                            "train/images_per_sec": 512.4, "train/data_wait": 0.123,
                            "progress/epoch_step": 8, "progress/epoch_steps": 40,
                            "progress/epoch_time_s": 20.0})
    console.log_metrics(40, {"epoch": 2, "train/epoch_loss": 1.1, "val/top1": 0.5,
                             "val/top5": 0.9, "val/loss": 1.4, "epoch/time_s": 101.0,
                             "run/remaining_s": 3725.0, "train/skipped": 2, "val/skipped": 1})
    console.log_metrics(60, {"epoch": 3, "val/top1": 0.6, "val/top5": 0.9, "val/loss": 1.3,
                             "epoch/time_s": 99.0, "run/remaining_s": 0.0})
    assert stream.getvalue().splitlines() == [
        "epoch 2/3 [8/40]  loss 1.2346  lr 0.05  512 img/s  data 12%  eta 01:20",
        "epoch 2/3  train loss 1.1000  val top-1 0.5000  top-5 0.9000  loss 1.4000  "
        "time 101.0s  left 1:02:05  skipped 3 images",
        "epoch 3/3  val top-1 0.6000  top-5 0.9000  loss 1.3000  time 99.0s  skipped 0 images"]


def test_the_epoch_summary_shows_the_emas_accuracy_beside_the_weights():
    stream = io.StringIO()
    ConsoleLogger(epochs=3, stream=stream).log_metrics(40, {
        "epoch": 3, "val/top1": 0.5, "val/top5": 0.9, "val/loss": 1.4, "val_ema/top1": 0.55,
        "val_ema/top5": 0.95, "val_ema/loss": 1.3})
    assert stream.getvalue().splitlines() == [
        "epoch 3/3  val top-1 0.5000  top-5 0.9000  loss 1.4000  EMA top-1 0.5500  "
        "top-5 0.9500  skipped 0 images"]

"""bin/bench.py sub-commands that run anywhere: model-only throughput, end to end, the loader,
what starting a run costs, the peers, and what each DALI pipeline reserves (gpu-check's
dali_memory part; the command itself is tests/test_gpu_check.py's)."""

import dataclasses
import json

import pytest
import torch

from app.bench import dali_reserve, reports
from conftest import REPO, run_tool


def bench(*args):
    """bin/bench.py's main() in this process, which imported torch and the model library once
    (`start` and `peers` time fresh processes: they start those themselves)."""
    return run_tool("bench.py", *args, cwd=REPO)


def test_model_bench_reports_ours_beside_the_peer(tmp_path):
    report = tmp_path / "model.json"
    result = bench("model", "-a", "test_resnet", "-b", "4", "--image-size", "32", "--device",
                   "cpu", "--steps", "2", "--warmup", "1", "--no-compile", "--sizes", "32,64",
                   "--optimizers", "sgd,lars", "--clip-grad-norm", "1", "--model-ema-steps", "2",
                   "--json", str(report))
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    rows = data["results"]
    sizes = data["sizes"]["results"]
    assert data["sizes"]["setting"] == "ours without compile"
    assert [(r["image_size"], r["pixels_vs_largest"]) for r in sizes] == [(32, 4.0), (64, 1.0)]
    assert all(r["speed_vs_largest"] == r["images_per_s"] / sizes[1]["images_per_s"]
               for r in sizes)
    assert "by image size (ours without compile)" in result.stdout
    optimizers = data["optimizers"]
    assert [r["label"] for r in optimizers] == [
        "ours without compile + sgd", "ours without compile + lars",
        "ours without compile + sgd, clip 1", "ours without compile + lars, clip 1"]
    assert all(r["step_vs_plain"] == r["step_ms"] / rows[0]["step_ms"] for r in optimizers)
    ema = data["ema"]
    assert ema["label"] == "ours without compile + EMA every 2"
    assert ema["step_vs_plain"] == ema["step_ms"] / rows[0]["step_ms"]
    assert [r["label"] for r in rows] == ["ours without compile", "pytorch/examples: fp32, NCHW"]
    assert all(r["images_per_s"] > 0 for r in rows)
    assert rows[-1]["ratio_to_peer"] == 1.0
    assert rows[0]["ratio_to_peer"] == rows[0]["images_per_s"] / rows[1]["images_per_s"]


def test_model_bench_hands_over_each_row_as_it_finishes():
    """What bin/bench.py model --json writes after each row (gpu-check's model part, killed
    at its deadline, keeps them): the rows so far, a ratio whose other row is still to come
    None; without the peer's setting, no ratio to it."""
    from app.bench import model
    snapshots = []
    report = model.run("test_resnet", 4, 32, "cpu", 1, 0, [model.OURS_EAGER], sizes=[32, 40],
                       progress=lambda report: snapshots.append(json.loads(json.dumps(report))))
    assert [len(s.get("sizes", {"results": []})["results"]) for s in snapshots] == [0, 1, 2, 2]
    first = snapshots[1]["sizes"]["results"][0]  # 32 px, before the 40 px row
    assert first["speed_vs_largest"] is None and first["pixels_vs_largest"] == (40 / 32) ** 2
    assert snapshots[-1]["sizes"]["results"][0]["speed_vs_largest"] is not None
    assert report["results"][0]["ratio_to_peer"] is None
    assert "ours without compile" in "\n".join(reports.model(report))


def test_e2e_bench_reports_ours_beside_the_peer_and_the_model_alone(tmp_path):
    report = tmp_path / "e2e.json"
    result = bench("e2e", "--catalog", str(REPO / "datasets.toml"), "--dataset", "sample_tiny",
                   "-a", "test_resnet", "-b", "8", "--image-size", "32", "-j", "1", "--device",
                   "cpu", "--steps", "3", "--warmup", "1", "--decoders", "pillow,nvjpeg",
                   "--json", str(report))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    peer, *ours = data["results"]  # the peer and the model alone once, each decoder after
    assert peer["label"] == "pytorch/examples recipe"
    assert [r["label"] for r in ours] == ["ours (pillow)", "ours (nvjpeg)"]
    assert all(r["images_per_s"] > 0 and r["cpu_cores"] > 0 for r in data["results"])
    for row in ours:
        assert row["ratio_to_peer"] == row["images_per_s"] / peer["images_per_s"]
        assert row["share_of_model_only"] == row["images_per_s"] / \
            data["model_only"]["images_per_s"]


def test_model_only_compiled_by_regions_is_the_trainers_compile():
    """e2e's model-only row compiles as training does (each block); the eager backend keeps
    it quick on a CPU."""
    from app.bench import model
    from app.runtime.private_api import compiled_graphs
    before = compiled_graphs()
    row = model.measure("test_resnet", dataclasses.replace(model.OURS_REGIONS, backend="eager"),
                        4, 32, "cpu", steps=2, warmup=1)
    assert row["compile"] == "regions" and row["images_per_s"] > 0
    assert compiled_graphs() - before == 4  # test_resnet's 4 blocks, all unlike


def test_e2e_bench_skips_dali_where_it_does_not_import(monkeypatch):
    from app.bench import loader
    monkeypatch.setattr(loader, "dali_imports", lambda: False)
    setup = loader.E2ESetup("datasets.toml", "sample_tiny", "test_resnet", 8, 32, 1, "cpu", 1, 1)
    assert loader.train_ours(setup, "dali") == {"label": "ours (dali)",
                                                "skipped": "NVIDIA DALI does not import here"}


def test_dali_reservations_subtract_torchs_own_allocations():
    before = {"gpu_free": 10_000, "torch_reserved": 100, "host_rss": 5_000, "host_pinned_vm": 0}
    after = {"gpu_free": 6_000, "torch_reserved": 1_100, "host_rss": 9_000, "host_pinned_vm": 0}
    assert dali_reserve.difference(before, after) == {
        "gpu_bytes": 3_000, "host_rss_bytes": 4_000, "host_pinned_vm_bytes": 0}
    assert dali_reserve.host_memory()["host_rss"] > 0


def test_dali_reservations_are_measured_with_the_cpu_operators_too():
    """The measurement's code path (open, first batch, close) as gpu-check's dali_memory part
    runs it, on a CPU: host figures only."""
    pytest.importorskip("nvidia.dali")
    measured = dali_reserve.measure(threads=2, batch_size=8, device=torch.device("cpu"))
    for split in ("train", "val"):
        assert measured[split]["first_batch_images"] == 8
        assert "gpu_bytes" not in measured[split]["build"]
        assert isinstance(measured[split]["build"]["host_rss_bytes"], int)


def test_model_bench_measures_the_batch_augmentations_beside_a_plain_step(tmp_path):
    report = tmp_path / "model.json"
    result = bench("model", "-a", "test_resnet", "-b", "8", "--image-size", "32", "--device",
                   "cpu", "--steps", "2", "--warmup", "1", "--no-compile", "--random-erase",
                   "0.5", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--json", str(report))
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert [r["label"] for r in data["results"]] == [
        "ours without compile", "ours without compile + batch augment",
        "pytorch/examples: fp32, NCHW"]
    extra = data["batch_augment"]
    assert (extra["random_erase"], extra["mixup_alpha"], extra["cutmix_alpha"]) == (0.5, 0.2, 1.0)
    assert extra["ms_per_step"] > 0
    assert extra["share_of_plain_step"] == extra["ms_per_step"] / data["results"][0]["step_ms"]
    assert "batch augment (erase 0.5, mixup 0.2, cutmix 1) alone" in result.stdout


def test_loader_bench_measures_each_decoder_plain_and_with_auto_augment(tmp_path):
    report = tmp_path / "loader.json"
    result = bench("loader", "--catalog", str(REPO / "datasets.toml"), "--dataset",
                   "sample_tiny", "-b", "16", "-j", "1", "--image-size", "32", "--batches", "2",
                   "--decoders", "pillow", "--auto-augment", "ta_wide,ra", "--no-peer",
                   "--json", str(report))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(report.read_text())["results"]
    assert [(r["decoder"], r["auto_augment"]) for r in rows] == \
        [("pillow", "off"), ("pillow", "ta_wide"), ("pillow", "ra")]
    assert all(r["images_per_s"] > 0 for r in rows) and rows[0]["ratio_to_plain"] == 1.0
    assert rows[1]["ratio_to_plain"] == rows[1]["images_per_s"] / rows[0]["images_per_s"]
    assert "ta_wide" in result.stdout
    refused = bench("loader", "--dataset", "sample_tiny", "--auto-augment", "augmix")
    assert refused.returncode == 2 and "unknown augmix" in refused.stderr


def test_start_bench_times_the_first_step_and_counts_every_process(tmp_path):
    """One worker, the peer's recipe in one process, and a restart of two ps workers after a
    killed worker: the first step comes after the command and before the run ends; the CPU is
    the machine's, so the run's own processes count (their imports alone are seconds); the
    restart is timed from the kill."""
    report = tmp_path / "start.json"
    result = bench("start", "-a", "resnet18", "--workers", "1", "-j", "1", "--sync", "ps",
                   "--restart", "--peer", "--repeats", "1", "--json", str(report))
    assert result.returncode == 0, result.stderr
    rows = {row["label"]: row for row in json.loads(report.read_text())["rows"]}
    assert set(rows) == {"ours 1 worker(s) -j 1", "peer 1 worker(s) -j 1",
                         "restart 2 worker(s) ps -j 1"}
    for label in ("ours 1 worker(s) -j 1", "peer 1 worker(s) -j 1"):
        assert 0 < rows[label]["median_first_step_s"] < rows[label]["median_wall_s"]
        assert rows[label]["median_cpu_s"] > 2
    restart = rows["restart 2 worker(s) ps -j 1"]
    assert 1 <= restart["median_first_step_s"] < 60  # its backoff is 1 s
    assert "ours 1 worker(s) -j 1" in result.stdout  # the table, printed


def test_peers_bench_runs_each_trainer_per_seed_on_the_same_folder(tmp_path, tiny_imagefolder):
    """Ours (with the CPU recipe) and pytorch/examples' recipe on one imagefolder, one seed:
    both learn (10 classes: chance is 0.1) and each run's top-1 is its last epoch's. timm's
    train.py is not part of the package, so it is left out here."""
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(f'[datasets.folder]\nurl = "{tiny_imagefolder}"\nlayout = "imagefolder"\n')
    report = tmp_path / "peers.json"
    result = bench("peers", "--catalog", str(catalog), "--dataset", "folder", "--trainers",
                   "ours,examples", "--seeds", "0", "--epochs", "2", "--image-size", "32",
                   "-b", "16", "-j", "1", "--json", str(report))
    assert result.returncode == 0, result.stderr
    runs = json.loads(report.read_text())["runs"]
    assert [run["trainer"] for run in runs] == ["ours", "examples"]
    for run in runs:
        assert 0.1 < run["top1"] <= 1.0, run
        assert len(run["epoch_top1"]) == 2 and run["epoch_top1"][-1] == run["top1"]
    summary = json.loads(report.read_text())["summary"]
    assert summary["ours"]["wall_vs_first"] == 1.0 and summary["examples"]["seeds"] == 1
    assert "examples" in result.stdout  # the table, printed


def test_peers_bench_runs_the_holders_fastai_code_beside_ours(tmp_path, tiny_imagefolder):
    """The Imagenette row's command (`--trainers ours,fastai` with the row's config and net)
    rehearsed on the tiny sample for one epoch each: every field of each run's record, and the
    batch each trainer kept: fastai drops the last partial batch (320 // 24 batches of 24),
    ours trains every image."""
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(f'[datasets.folder]\nurl = "{tiny_imagefolder}"\nlayout = "imagefolder"\n')
    report = tmp_path / "peers.json"
    result = bench("peers", "--catalog", str(catalog), "--dataset", "folder", "--trainers",
                   "ours,fastai", "--config", "configs/imagenette_128_5_cpu.toml", "-a",
                   "xse_resnext_mini", "--seeds", "3", "--epochs", "1", "--image-size", "32",
                   "-b", "24", "-j", "1", "--ours-args", "--val-resize-size 32 --val-crop-size 32",
                   "--json", str(report))
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    runs = {run["trainer"]: run for run in data["runs"]}
    assert [run["trainer"] for run in data["runs"]] == ["ours", "fastai"]
    assert runs["ours"]["train_images"] == 320 and runs["fastai"]["train_images"] == 13 * 24
    assert "app.bench.peer_fastai" in runs["fastai"]["command"]
    assert "--seed 3" in runs["fastai"]["command"] and "--bs 24" in runs["fastai"]["command"]
    assert runs["ours"]["command"].endswith("--val-resize-size 32 --val-crop-size 32")
    for run in runs.values():
        assert run["seed"] == 3 and len(run["epoch_top1"]) == 1
        assert 0 <= run["top1"] == run["epoch_top1"][-1] <= 1
        assert 0 < run["train_images_per_s"] and 0 < run["wall_s"]
        assert run["train_images"] / run["train_images_per_s"] < run["wall_s"]
        assert run["cpu_s"] > 1  # at least the imports of the trainer's process
    assert data["machine"]["cores"] >= 1 and data["machine"]["torch"]
    summary = data["summary"]
    assert summary["fastai"]["wall_vs_first"] == summary["fastai"]["wall_s_mean"] / \
        summary["ours"]["wall_s_mean"]
    assert summary["ours"]["top1_sem"] is None  # one seed: no spread to estimate it from
    assert "fastai" in result.stdout  # the table, printed


def test_peers_bench_needs_timms_train_py_for_timm():
    result = bench("peers", "--trainers", "ours,timm")
    assert result.returncode == 2 and "--timm-train" in result.stderr


# the schedulers are stepped without an optimizer step on purpose: only their LRs are read
@pytest.mark.filterwarnings("ignore:Detected call of .lr_scheduler.step\\(\\).:UserWarning")
def test_peers_give_timm_our_recipe_the_same_lr_at_every_step(tmp_path):
    """--peer-recipe ours: train.py's flags, read back through timm's own scheduler factory,
    give the LR our ffcv schedule gives at every update of a 5-epoch run (to within our
    schedule's 1e-4 start), and the optimizer, decay and smoothing of our config."""
    import timm.scheduler  # noqa: PLC0415

    from app.bench.peers import Setup, timm_command
    from app.config.sources import file_overrides, make_config
    from app.training.optim import build_scheduler

    setup = Setup("datasets.toml", "imagenette_local", "configs/imagenette_cpu.toml", "resnet18",
                  64, 64, 5, 2, "train.py", peer_recipe="ours")
    for name in ("a", "b"):
        (tmp_path / "train" / name).mkdir(parents=True)
    command = timm_command(setup, 0, tmp_path / "out", tmp_path)
    flags = {}
    for flag, value in zip(command, [*command[1:], ""]):
        if flag.startswith("--"):
            flags[flag[2:]] = "" if value.startswith("--") else value
    steps = 148  # Imagenette's 9,469 photos at batch 64

    def lrs(scheduler, count, step):
        out = []
        for update in range(count):
            out.append(scheduler.optimizer.param_groups[0]["lr"])
            step(update + 1)
        return out
    theirs_optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)],
                                       lr=float(flags["lr"]))
    theirs, epochs = timm.scheduler.create_scheduler_v2(
        theirs_optimizer, sched=flags["sched"], num_epochs=int(flags["epochs"]),
        decay_rate=float(flags["decay-rate"]), min_lr=float(flags["min-lr"]),
        warmup_lr=float(flags["warmup-lr"]), warmup_epochs=int(flags["warmup-epochs"]),
        warmup_prefix="warmup-prefix" in flags, step_on_epochs="sched-on-updates" not in flags,
        updates_per_epoch=steps)
    config = make_config(file_overrides(str(REPO / setup.config)))
    ours_optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)],
                                     lr=config.optim.lr * 64 / 256)
    ours = build_scheduler(ours_optimizer, config.optim, steps, 5)
    theirs_lrs = lrs(theirs, epochs * steps, lambda n: theirs.step_update(num_updates=n))
    ours_lrs = lrs(ours, 5 * steps, lambda n: ours.step())
    assert epochs == 5 and len(theirs_lrs) == len(ours_lrs)
    assert max(abs(a - b) for a, b in zip(theirs_lrs, ours_lrs)) < 2e-4 * max(ours_lrs)
    assert max(ours_lrs) == pytest.approx(0.125, rel=1e-3)
    assert (flags["opt"], flags["momentum"], flags["weight-decay"], flags["smoothing"]) == (
        "sgd", "0.9", "5e-05", "0.1")


@pytest.mark.parametrize("native_bf16", [True, False])
def test_peers_give_timm_our_precision_on_a_cpu(tmp_path, monkeypatch, native_bf16):
    """--peer-recipe ours on a CPU: train.py computes in bf16 and channels_last exactly where
    ours does (a CPU with bf16 instructions); with its own recipe, in its default fp32."""
    from app.bench.peers import Setup, timm_command
    from app.training import precision

    monkeypatch.setattr(precision, "cpu_computes_bf16", lambda: native_bf16)
    (tmp_path / "train" / "a").mkdir(parents=True)
    commands = {recipe: timm_command(Setup("datasets.toml", "imagenette_local",
                                           "configs/imagenette_cpu.toml", "resnet18", 64, 64, 5,
                                           2, "train.py", peer_recipe=recipe),
                                     0, tmp_path / "out", tmp_path)
                for recipe in ("ours", "own")}
    ours = " ".join(commands["ours"])
    assert ("--amp --amp-dtype bfloat16" in ours, "--channels-last" in ours) == (native_bf16,) * 2
    assert "--amp" not in commands["own"] and "--channels-last" not in commands["own"]

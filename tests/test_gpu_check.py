"""gpu-check on CPU: its runner's parts one after the other, each killed at its deadline with
what it started, each report on disk the moment its part ends, the budget shared out; the real
parts' commands accepted by the scripts they call (most can only run on a GPU); and the command
itself on a machine without a GPU: it says so, with the parts that run anywhere."""

import dataclasses
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from app.bench import gpu_check, peer_examples, peers, reports
from app.bench.cli import build_parser, peers_run
from app.bench.part_runner import (MIN_PART_S, STOP_S, Part, Paths, part_environment, run_parts,
                                   sized, time_for)
from app.config.sources import parse_config
from app.models.factory import create_model_from_config
from app.models.xse_resnext_mini import XSEResNeXtMini
from conftest import REPO
from test_bench import bench


def writes_report(name: str, figures: dict) -> Part:
    """A part that writes `figures` as its JSON report, as the real parts' scripts do."""
    def command(paths: Paths) -> list[str]:
        return [sys.executable, "-c", f"import json, pathlib; pathlib.Path("
                f"{str(paths.report(name))!r}).write_text(json.dumps({figures!r}))"]
    return Part(name, "writes its figures", 30, command,
                summary=lambda f: [f"- value {f['value']}"])


def overruns(seen: Path, archive: Path, child_pid: Path) -> Part:
    """Checks that the first part's report is already on disk, and in the archive, starts a
    child that would outlive it, then sleeps far past its deadline."""
    code = ("import os, subprocess, sys, tarfile, time, pathlib\n"
            f"assert pathlib.Path({str(seen)!r}).exists(), 'no report of the first part yet'\n"
            f"assert 'out/first.json' in tarfile.open({str(archive)!r}).getnames()\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"pathlib.Path({str(child_pid)!r}).write_text(str(child.pid))\n"
            "print('started', flush=True)\n"
            "time.sleep(120)\n")
    return Part("slow", "sleeps past its deadline", 3, lambda paths: [sys.executable, "-c", code])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and \
        Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_part_past_its_deadline_is_killed_and_the_later_parts_still_run(tmp_path):
    paths = Paths(tmp_path / "out", tmp_path / "work", tmp_path / "back" / "gpu-check.tar.gz")
    child_pid = tmp_path / "child.pid"
    paths.archive.parent.mkdir()
    parts = [writes_report("first", {"value": 1}),
             overruns(paths.out / "first.json", paths.archive, child_pid),
             writes_report("after", {"value": 3})]
    outcomes = run_parts(parts, 60, paths, dict(os.environ))
    assert [o["status"] for o in outcomes] == ["ok", "killed at its deadline (3 s)", "ok"]
    assert 3 <= outcomes[1]["seconds"] < 20  # killed at 3 s, not after its 120 s
    assert not alive(int(child_pid.read_text()))  # what the part started went with it
    for outcome in outcomes:  # each part's report on disk, as written when it ended
        assert json.loads((paths.out / f"{outcome['name']}.json").read_text()) == outcome
    assert outcomes[0]["figures"] == {"value": 1} and outcomes[2]["figures"] == {"value": 3}
    assert "started" in (paths.out / "slow.log").read_text()
    summary = (paths.out / "summary.md").read_text()
    assert "| slow | sleeps past its deadline | killed at its deadline (3 s) |" in summary
    assert "## first\n\n- value 1" in summary and "## after\n\n- value 3" in summary
    with tarfile.open(paths.archive) as archive:  # the whole folder, as the last part left it
        assert archive.extractfile("out/summary.md").read().decode() == summary
        assert {"out/first.json", "out/slow.log", "out/after.json"} <= set(archive.getnames())


def test_the_budget_is_shared_out_and_a_part_without_any_is_not_started(tmp_path):
    """A part gets what is left of the budget less what later parts reserve; one with too
    little is not started. The run folder and report of a part that ran before (a rerun) are
    gone before it starts."""
    paths = Paths(tmp_path / "out", tmp_path / "work")
    stale = paths.runs / "reserved" / "metrics.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"step": 1}\n')
    paths.out.mkdir()
    paths.report("reserved").write_text('{"value": "last call\'s"}')
    (paths.out / "reserved.xml").write_text("<testsuites/>")
    sleeper = Part("sleeper", "sleeps 30 s", 100,
                   lambda paths: [sys.executable, "-c", "import time; time.sleep(30)"])
    reserved = Part("reserved", "keeps 3 s", 3, lambda paths: [
        sys.executable, "-c", "import pathlib; assert not any(pathlib.Path(p).exists() for p in "
        f"{[str(stale), str(paths.out / 'reserved.xml')]!r})"], reserved_s=3)
    outcomes = run_parts([sleeper, writes_report("late", {"value": 2}), reserved],
                         9 + STOP_S, paths, dict(os.environ))
    # the budget less the reserved 3 s and the time to kill it, not its own 100 s
    assert outcomes[0]["status"] == "killed at its deadline (6 s)"
    assert outcomes[1]["status"].startswith("not run: ")  # what is left is reserved
    assert json.loads((paths.out / "late.json").read_text())["figures"] is None
    assert outcomes[2]["status"] == "ok" and outcomes[2]["figures"] is None


def test_the_plan_gives_each_part_its_deadline_and_the_gpu_tests_their_slice():
    """The real parts in the default budget and in the smallest that holds them (600 s): each
    part up to the gpu tests gets its whole deadline when every one before it runs to its own;
    the tests get theirs even when each part before them also takes STOP_S to be killed (those
    at the end of the line get less); the extras come after the tests."""
    parts = gpu_check.chosen("", 600)
    tests = [p.name for p in parts].index("gpu_tests")
    assert parts[tests].reserved_s >= 60 and parts[tests].deadline_s == parts[tests].reserved_s
    assert sum(p.deadline_s for p in parts[:tests + 1]) + STOP_S == 600
    assert [p.name for p in parts[:tests]] == ["probe", "imagenette", "prepare", "gpus_ps",
                                               "e2e"]
    assert [p.name for p in parts[tests + 1:]] == [
        "gpus_allreduce", "sync", "dali_memory", "model", "start"]
    assert build_parser().parse_args(["gpu-check"]).budget == gpu_check.BUDGET_S == 1800
    for budget, late_by in ((600, 0.0), (600, STOP_S), (gpu_check.BUDGET_S, STOP_S)):
        parts, left = gpu_check.chosen("", budget), budget
        for index, part in enumerate(parts[:tests + 1]):
            given = time_for(parts, index, left)
            if late_by == 0.0 or index == tests or budget == gpu_check.BUDGET_S:
                assert given == part.deadline_s, (part.name, budget, late_by)
            if given >= MIN_PART_S:  # else it is not started
                left -= given + late_by


def test_a_larger_budget_goes_to_the_gpu_tests_the_others_keep_their_deadlines():
    default = {p.name: p.deadline_s for p in gpu_check.chosen("", gpu_check.BUDGET_S)}
    hour = {p.name: p.deadline_s for p in gpu_check.chosen("", 3600)}
    others = sum(s for name, s in default.items() if name != "gpu_tests")
    assert hour == {**default, "gpu_tests": 3600 - others - STOP_S}
    assert [(p.name, p.deadline_s) for p in gpu_check.chosen("probe,gpu_tests", 600)] == [
        ("probe", 30), ("gpu_tests", 600 - 30 - STOP_S)]
    steady = Part("steady", "", 50, lambda paths: [])
    assert sized([steady], 1000) == [steady]  # only a growing part grows

def test_every_real_part_calls_its_script_with_flags_it_accepts(tmp_path):
    """The parts can run only on a GPU: their command lines are checked here."""
    paths = Paths(tmp_path / "out", tmp_path / "work")
    every = gpu_check.parts()
    assert [p.name for p in every][:3] == ["probe", "imagenette", "prepare"]
    for part in every:
        command = part.command(paths)
        assert command[0] == sys.executable, part.name
        script = Path(command[1]).name if command[1].endswith(".py") else command[2]
        if script == "bench.py":
            args = build_parser().parse_args(command[2:])
            if part.name == "imagenette":
                imagenette_runs_accept_their_flags(args, paths)
        elif script == "driver.py":
            config, _ = parse_config(command[2:])
            assert config.run.output_dir.startswith(str(paths.work))  # not into --out
        else:
            assert script in ("app.bench.probe", "app.bench.dali_reserve", "pytest"), part.name


def imagenette_runs_accept_their_flags(row, paths: Paths) -> None:
    """The row as published, on fast.ai's archive (the user's copy with IMAGENETTE_ROOT): our
    driver's command parses to the config's recipe, the 2020 holder's (its SE-ResNeXt, built
    here, Ranger, batch 32, the shorter-side crop at 128 px throughout), the peer's to
    torchvision's ResNet-50."""
    assert (row.dataset, row.seeds, row.device, row.trainers, row.deadline) == (
        "imagenette" if not os.environ.get("IMAGENETTE_ROOT") else "imagenette_local", "0,1,2",
        "cuda:0", "ours,examples", 0.0)
    assert row.json == str(paths.report("imagenette"))
    setup, *_ = peers_run(row)
    config, _ = parse_config(peers.ours_command(setup, 0, paths.work, paths.work)[2:])
    assert (config.model.arch, config.data.image_size, config.data.progressive_start_size,
            config.train.batch_size, config.train.epochs, config.train.compile) == (
        "xse_resnext_mini", 128, 0, 32, 5, "off")
    assert (config.optim.optimizer, config.augment.train_crop, config.data.val_resize_size) == (
        "ranger", "shorter-side", 128)
    model = create_model_from_config(config.model, 10, with_pretrained=False)
    assert isinstance(model, XSEResNeXtMini)
    peer = peer_examples.parse(peers.examples_command(setup, 0, paths.work, paths.work)[3:])
    assert (peer.arch, peer.image_size, peer.batch_size, peer.epochs, peer.device) == (
        "resnet50", 128, 32, 5, "cuda")


def test_the_gpu_tests_run_fastest_first_from_the_files_that_hold_them(tmp_path):
    """The part's own pytest command, collecting only: the files with gpu tests, and not
    those that import packages the GPU machine lacks (boto3, nbclient), collected without an
    error; tests that stay in their process first, then by the driver processes they
    start."""
    assert gpu_check.gpu_tests_command(tmp_path / "t.xml", 4, "")[-2:] == ["-n", "4"]  # xdist
    part = next(p for p in gpu_check.parts(gpu_check.Options(test_processes=1))
                if p.name == "gpu_tests")
    command = part.command(Paths(tmp_path, tmp_path))
    files = [arg for arg in command if arg.startswith("tests/")]
    assert "tests/test_gpu.py" in files and "tests/test_precision.py" in files
    assert not {"tests/test_shards.py", "tests/test_notebook.py"} & set(files)
    collected = subprocess.run(
        [arg for arg in command if arg != "-v"] + ["--collect-only", "-q"], cwd=REPO,
        capture_output=True, text=True, timeout=120,
        env={**os.environ, **part.env})
    assert collected.returncode == 0, collected.stdout[-2000:]
    order = [line for line in collected.stdout.splitlines() if "::" in line]
    assert {test.split("::")[0] for test in order} >= {"tests/test_gpu.py",
                                                       "tests/test_precision.py"}
    first_driver = next(i for i, test in enumerate(order) if "two_workers_sharing" in test)
    assert all("no_host_sync" not in test and "cuda_generator" not in test
               and "test_precision.py" not in test for test in order[first_driver:])
    assert order[-1].endswith("test_sigterm_then_resume_on_the_gpu_continues")


def test_the_verdict_wants_a_gpu_every_part_ok_and_a_gpu_test_passed():
    probe = {"name": "probe", "status": "ok", "figures": {"gpus": [{"name": "H100"}]}}

    def tests(counts: dict, status: str = "ok") -> dict:
        return {"name": "gpu_tests", "status": status, "figures": {"counts": counts}}

    assert gpu_check.verdict([probe, tests({"passed": 3, "skipped": 1})]) == ("ok", 0)
    assert gpu_check.verdict([probe, tests({"skipped": 4})]) == ("failed", 1)  # proves nothing
    assert gpu_check.verdict([probe, tests({"passed": 2, "failed": 1}, "failed (exit 1)")]) == \
        ("failed", 1)
    killed = {"name": "e2e", "status": "killed at its deadline (100 s)", "figures": None}
    assert gpu_check.verdict([probe, killed]) == ("failed", 1)
    assert gpu_check.verdict([{**probe, "figures": {"gpus": []}}, tests({"skipped": 4})]) == \
        ("no CUDA GPU", 2)


def test_gpu_check_on_a_machine_without_a_gpu_says_so(tmp_path):
    """The parts that run anywhere: the probe finds no GPU, the DALI part states the formula
    without measuring, every gpu test is skipped; the verdict says why, and the archive holds
    the report folder as the last part left it."""
    result = bench("gpu-check", "--parts", "probe,dali_memory,gpu_tests", "-n", "1",
                   "--budget", "240", "--out", str(tmp_path / "out"), "--work",
                   str(tmp_path / "work"), "--archive", str(tmp_path / "gc.tar.gz"))
    out = tmp_path / "out"
    parts = {name: json.loads((out / f"{name}.json").read_text())
             for name in ("probe", "dali_memory", "gpu_tests")}
    assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(parts, "ok")
    assert parts["probe"]["figures"]["versions"]["torch"] == torch.__version__
    dali = parts["dali_memory"]["figures"]  # the defaults: 8 threads, batch 256
    assert dali["expected"]["train"]["gpu_bytes"] == 8 * 211_025_920
    assert dali["expected"]["val"]["pinned_bytes"] == 2 * 8 * 2**23
    tests = {t["name"].rsplit("::", 1)[-1]: t for t in parts["gpu_tests"]["figures"]["tests"]}
    assert "test_no_host_sync_inside_a_training_step[off-bf16]" in tests
    assert any(name.startswith("test_two_gpus_match_one") for name in tests)
    with tarfile.open(tmp_path / "gc.tar.gz") as archive:
        assert {"out/probe.json", "out/dali_memory.report.json", "out/gpu_tests.xml",
                "out/summary.md"} <= set(archive.getnames())
        assert archive.extractfile("out/summary.md").read() == (out / "summary.md").read_bytes()
    if torch.cuda.is_available():  # on a GPU machine: its own verdict
        assert (result.returncode == 0) == ("verdict: ok" in result.stdout)
        return
    assert result.returncode == 2 and "verdict: no CUDA GPU" in result.stdout
    assert parts["probe"]["figures"]["gpus"] == []
    assert {t["outcome"] for t in tests.values()} == {"skipped"}
    assert dali["measured"] is None and dali["why_not"] == "no CUDA GPU"
    summary = (out / "summary.md").read_text()
    assert "- GPUs: none" in summary
    assert "- train: expected GPU 1,610 MiB, pinned 2,145 MiB (8 threads)" in summary
    refused = bench("gpu-check", "--parts", "nonsense", "--out", str(tmp_path / "x"))
    assert refused.returncode == 2 and "unknown parts nonsense" in refused.stderr


WNIDS = ("n01440764", "n02102040")  # Imagenette's first two classes
TRAIN_EACH, VAL_EACH = 6, 3
# the imagenette part at a tiny size on a CPU: one seed, one epoch, a small model for ours and
# for the peer (the config's progressive resizing still trains at 96 px, evaluates at 128 px)
REHEARSAL = ("--device", "cpu", "-a", "test_resnet", "--peer-arch", "resnet18", "--image-size",
             "32", "-b", "4", "--epochs", "1", "-j", "0", "--seeds", "0")


def tiny_photos(folder: Path) -> Path:
    """Noisy 90x120 JPEGs in Imagenette's layout, one colour per class; one of them a PNG."""
    rng = np.random.default_rng(0)
    for split, count in (("train", TRAIN_EACH), ("val", VAL_EACH)):
        for label, wnid in enumerate(WNIDS):
            (folder / split / wnid).mkdir(parents=True)
            for index in range(count):
                pixels = rng.integers(0, 60, (90, 120, 3), dtype=np.uint8)
                pixels[..., label] += 180
                kind = "PNG" if (split, label, index) == ("train", 1, 0) else "JPEG"
                Image.fromarray(pixels).save(folder / split / wnid / f"{split}_{index}.JPEG",
                                             format=kind)
    return folder


def test_the_imagenette_part_says_why_it_fails_then_trains_on_the_users_photos(tmp_path,
                                                                                monkeypatch):
    """The imagenette part through gpu-check's runner, at a tiny size on a CPU: failed, with
    the catalog's reason, where IMAGENETTE_ROOT names no folder; then ours and the peer train
    on the photos it names, each run's top-1 after its epoch read from the photos' own val set
    (6 photos: a multiple of 1/6)."""
    paths = Paths(tmp_path / "out", tmp_path / "work")
    row = next(p for p in gpu_check.parts() if p.name == "imagenette")
    part = dataclasses.replace(row, command=lambda paths: [*row.command(paths), *REHEARSAL])
    monkeypatch.setenv("IMAGENETTE_ROOT", str(tmp_path / "nowhere"))
    failed = run_parts([part], 60, paths, part_environment(paths))[0]
    assert failed["status"] == "failed (exit 2)" and failed["figures"] is None
    assert f"error: dataset 'imagenette_local': root {tmp_path / 'nowhere'} not found" in \
        failed["log_tail"]
    monkeypatch.setenv("IMAGENETTE_ROOT", str(tiny_photos(tmp_path / "photos")))
    # the runner tells the part its deadline: a long one, so that the peer's run fits however
    # loaded this machine is
    outcome = run_parts([dataclasses.replace(part, deadline_s=600)], 600, paths,
                        part_environment(paths))[0]
    assert outcome["status"] == "ok", outcome["log_tail"]
    figures = outcome["figures"]
    assert figures["deadline_s"] == 600 and figures["not_run"] == []
    assert figures["root"] == str(tmp_path / "photos")
    assert figures["setup"]["config"] == "configs/imagenette_128_5.toml"
    assert [(r["trainer"], r["seed"]) for r in figures["runs"]] == [("ours", 0), ("examples", 0)]
    for run in figures["runs"]:
        assert len(run["epoch_top1"]) == 1 and run["top1"] == run["epoch_top1"][0]
        assert abs(run["top1"] * 6 - round(run["top1"] * 6)) < 1e-6 and 0 < run["wall_s"] < 600
    summary = (paths.out / "summary.md").read_text()
    assert "| trainer | seed | top-1 after epoch 1 | wall |" in summary
    assert f"| ours | 0 | {figures['runs'][0]['top1']:.4f} |" in summary


def test_the_imagenette_part_starts_only_runs_expected_to_end_in_time():
    """A trainer's later runs are expected to take its longest so far (with room); its first,
    twice the longest of any; and what was left out is said in the summary."""
    runs = [{"trainer": "ours", "wall_s": 30.0}, {"trainer": "ours", "wall_s": 40.0}]
    assert peers.expected_s("ours", []) == 0.0  # the first run of all always starts
    assert peers.expected_s("ours", runs) == 40.0 * peers.RUN_FACTOR
    assert peers.expected_s("examples", runs) == 40.0 * peers.FIRST_RUN_FACTOR
    figures = {"setup": {"arch": "xse_resnext_mini", "image_size": 128, "epochs": 5,
                         "batch_size": 32, "workers": 12}, "root": "/photos",
               "runs": [], "summary": {},
               "not_run": [{"trainer": "examples", "seed": 0, "expected_s": 80.0,
                            "left_s": 31.0}]}
    assert reports.peers(figures)[-1] == ("- not run, it would not end within the part's "
                                          "deadline: examples seed 0 (~80 s, 31 s left)")

"""gpu-day's runner on CPU: parts one after the other, each killed at its deadline with what
it started, each report on disk the moment its part ends, the budget shared out; and the real
parts' commands accepted by the scripts they call (they can only run on a GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from app.bench import gpu_day_parts
from app.bench.cli import build_parser
from app.bench.gpu_day import Part, Paths, run_parts
from app.config.sources import parse_config
from conftest import REPO
from test_bench import bench


def writes_report(name: str, figures: dict) -> Part:
    """A part that writes `figures` as its JSON report, as the real parts' scripts do."""
    def command(paths: Paths) -> list[str]:
        return [sys.executable, "-c", f"import json, pathlib; pathlib.Path("
                f"{str(paths.report(name))!r}).write_text(json.dumps({figures!r}))"]
    return Part(name, "writes its figures", 30, command,
                summary=lambda f: [f"- value {f['value']}"])


def overruns(seen: Path, child_pid: Path) -> Part:
    """Checks that the first part's report is already on disk, starts a child that would
    outlive it, then sleeps far past its deadline."""
    code = ("import os, subprocess, sys, time, pathlib\n"
            f"assert pathlib.Path({str(seen)!r}).exists(), 'no report of the first part yet'\n"
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
    paths = Paths(tmp_path / "out", tmp_path / "work")
    child_pid = tmp_path / "child.pid"
    parts = [writes_report("first", {"value": 1}),
             overruns(paths.out / "first.json", child_pid),
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


def test_the_budget_is_shared_out_and_a_part_without_any_is_not_started(tmp_path):
    paths = Paths(tmp_path / "out", tmp_path / "work")
    sleeper = Part("sleeper", "sleeps 30 s", 100,
                   lambda paths: [sys.executable, "-c", "import time; time.sleep(30)"])
    outcomes = run_parts([sleeper, writes_report("late", {"value": 2})], 6, paths,
                         dict(os.environ))
    assert outcomes[0]["status"] == "killed at its deadline (6 s)"  # the budget, not its 100 s
    assert outcomes[1]["status"].startswith("not run: ")
    assert json.loads((paths.out / "late.json").read_text())["figures"] is None


def test_every_real_part_calls_its_script_with_flags_it_accepts(tmp_path):
    """The parts can run only on a GPU: their command lines are checked here."""
    paths = Paths(tmp_path / "out", tmp_path / "work")
    assert [p.name for p in gpu_day_parts.PARTS][:2] == ["probe", "prepare"]
    for part in gpu_day_parts.PARTS:
        command = part.command(paths)
        assert command[0] == sys.executable, part.name
        script = Path(command[1]).name if command[1].endswith(".py") else command[2]
        if script == "bench.py":
            build_parser().parse_args(command[2:])
        elif script == "driver.py":
            config, _ = parse_config(command[2:])
            assert config.run.output_dir.startswith(str(paths.work))  # not into --out
        else:
            assert script in ("app.bench.probe", "pytest"), part.name


def test_the_gpu_tests_report_holds_the_tests_that_ended_before_a_kill(tmp_path):
    paths = Paths(tmp_path, tmp_path)
    (tmp_path / "gpu_tests.log").write_text(
        "tests/test_gpu.py::test_checkpoints_hold_the_workers_own_cuda_generator PASSED [ 4%]\n"
        "tests/test_gpu.py::test_two_workers_sharing_one_gpu_match_one_worker[ps-float32, "
        "TF32 off] FAILED [ 8%]\n"
        "tests/test_gpu.py::test_two_gpus_match_one[ps] SKIPPED (needs two CUDA GPUs) [12%]\n"
        "tests/test_gpu.py::test_sigterm_then_resume_on_the_gpu_continues ")  # cut off here
    figures = gpu_day_parts.test_figures(paths, "gpu_tests")
    assert figures["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert figures["tests"][1] == {"name": "tests/test_gpu.py::test_two_workers_sharing_one_"
                                           "gpu_match_one_worker[ps-float32, TF32 off]",
                                   "outcome": "failed"}
    assert gpu_day_parts.test_lines(figures)[0] == "- 1 passed, 1 failed, 1 skipped"


def test_the_gpu_tests_run_fastest_first():
    """Tests that stay in their process first, then by the driver processes they start."""
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-m",
         "gpu or gpu2", "tests/test_gpu.py"], cwd=REPO, capture_output=True, text=True,
        timeout=120, env={**os.environ, "IMAGENET_DP_TESTS_FASTEST_FIRST": "1"}).stdout
    order = [line for line in collected.splitlines() if "::" in line]
    first_driver = next(i for i, test in enumerate(order) if "two_workers_sharing" in test)
    assert all("no_host_sync" not in test and "cuda_generator" not in test
               for test in order[first_driver:])
    assert order[-1].endswith("test_sigterm_then_resume_on_the_gpu_continues")


def test_gpu_day_probes_a_machine_without_a_gpu(tmp_path):
    result = bench("gpu-day", "--parts", "probe", "--budget", "60", "--out",
                   str(tmp_path / "out"), "--work", str(tmp_path / "work"))
    assert result.returncode == 0, result.stderr[-2000:]
    probe = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert probe["status"] == "ok" and probe["figures"]["gpus"] == []
    assert "- GPUs: none" in (tmp_path / "out" / "summary.md").read_text()
    refused = bench("gpu-day", "--parts", "nonsense", "--out", str(tmp_path / "x"))
    assert refused.returncode == 2 and "unknown parts nonsense" in refused.stderr

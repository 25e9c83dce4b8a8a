"""One command that checks a GPU machine: what it is, whether the `gpu` tests pass on it, what
each DALI pipeline reserves (app/bench/dali_reserve.py) and how fast the model trains there, in
one JSON report.

It needs only an interpreter with the training dependencies (torch, torchvision, timm, pandas,
fsspec, Pillow, numpy, tomli_w) and pytest: no `make setup`, no network, whatever versions the
machine has. Tests that need packages it lacks (wandb, moto, obstore, DALI) skip themselves.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from app.runtime.errors import UserError

REPO = Path(__file__).resolve().parents[2]
GPU_MARK = re.compile(r"pytest\.mark\.gpu2?\b")
REQUIRED = ("torch", "torchvision", "timm", "pandas", "fsspec", "PIL", "numpy", "tomli_w",
            "pytest")
OPTIONAL = ("nvidia.dali", "obstore", "s3fs", "wandb")
WHEELS_HINT = ("bring missing pure-Python packages as wheels (see ../shared/DEVICE.md and "
               "the device tool's README)")


def check_requirements() -> None:
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"gpu-check needs {', '.join(missing)} in this interpreter "
                        f"({sys.executable}); {WHEELS_HINT}")


def version_of(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 (an optional package that fails to import is absent)
        return None


def environment() -> dict:
    import torch  # noqa: PLC0415
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append({"index": index, "name": props.name,
                         "memory_gb": round(props.total_memory / 2**30, 1),
                         "capability": f"{props.major}.{props.minor}"})
    return {
        "python": platform.python_version(), "executable": sys.executable,
        "platform": platform.platform(), "cpu_count": _cpu_count(),
        "versions": {name: version_of(name) for name in (*REQUIRED, *OPTIONAL)},
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()
        if torch.backends.cudnn.is_available() else None,
        "gpus": gpus,
    }


def _cpu_count() -> int:
    import os  # noqa: PLC0415
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def run_tests(folder: Path, timeout_s: float, parallel: int, select: str) -> dict:
    """pytest -m gpu over tests/ in a child process; every test's outcome from its JUnit XML.
    With pytest-xdist, `parallel` test processes share the GPU (most tests are driver runs that
    leave it idle while they start), which keeps the whole check inside a 10-minute window."""
    xml, log = folder / "gpu-tests.xml", folder / "gpu-tests.log"
    # -v and a log file: should the whole run time out, the log still says which tests ended
    # and how; each test's own limit (pytest-timeout) is kept under the whole run's.
    # a test module that needs a package the machine lacks (hypothesis, moto) must not stop
    # the collection of the others
    command = [sys.executable, "-m", "pytest", "-m", "gpu or gpu2", "-p", "no:cacheprovider",
               "-v", "--continue-on-collection-errors", f"--junitxml={xml}", *gpu_test_files()]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += [f"--timeout={max(30, int(timeout_s / 2))}"]
    if parallel > 1 and importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(parallel)]
    if select:
        command += ["-k", select]
    started = time.perf_counter()
    with log.open("w") as output:
        try:
            code = subprocess.run(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                                  timeout=timeout_s).returncode
            verdict = ""
        except subprocess.TimeoutExpired:
            code, verdict = None, f"\npytest did not finish within {timeout_s:.0f} s"
    tail = log.read_text(errors="replace")[-4000:] + verdict
    tests = parse_junit(xml) if xml.exists() else []
    return {"command": " ".join(command), "exit_code": code, "seconds":
            round(time.perf_counter() - started, 1), "tests": tests,
            "counts": {outcome: sum(t["outcome"] == outcome for t in tests)
                       for outcome in ("passed", "failed", "error", "skipped")},
            "output_tail": tail}


def gpu_test_files() -> list[str]:
    """The test files that hold gpu tests: the others are not collected (some import packages
    the GPU machine lacks, boto3 and nbclient, and collecting them all, in each test process,
    costs more than the gpu tests that a machine without a GPU skips)."""
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").glob("test_*.py")
                  if GPU_MARK.search(path.read_text()))


def parse_junit(path: Path) -> list[dict]:
    tests = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = "failed" if kind == "failure" else kind
                message = (found.get("message") or found.text or "").strip().splitlines()
                message = message[0][:300] if message else ""
                break
        tests.append({"name": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": message})
    return tests


def probe(quick: bool) -> dict:
    """ResNet-50 model-only img/s at 224 px, batch 256: ours (compiled unless `quick`) beside
    the peer's numerics, in the same run."""
    from app.bench import model  # noqa: PLC0415 (imports torch and timm)
    settings = [model.OURS_EAGER, model.PEER] if quick else [model.OURS, model.OURS_EAGER,
                                                               model.PEER]
    return model.run("resnet50", 256, 224, "cuda", steps=20 if quick else 50, warmup=5,
                     settings=settings)


@dataclass(frozen=True)
class DaliSetup:
    """The pipelines whose reservations are measured: per-worker decoding threads (-j) and
    batch size, on a generated sample."""
    threads: int = 8
    batch_size: int = 256
    sample: str = "tiny"


def run(out: Path, quick: bool, probe_too: bool, tests_timeout_s: float, parallel: int,
        select: str, dali: DaliSetup = DaliSetup()) -> tuple[dict, int]:
    """The report, and the exit code: 0 when a GPU is there and every gpu test passed."""
    check_requirements()
    from app.bench import dali_reserve  # noqa: PLC0415 (imports torch)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "environment": environment()}
    out.parent.mkdir(parents=True, exist_ok=True)
    report["tests"] = run_tests(out.parent, tests_timeout_s, parallel, select)
    has_gpu = bool(report["environment"]["gpus"])
    # before the probe, which grows torch's allocator in this process
    report["dali_memory"] = dali_reserve.run(dali.threads, dali.batch_size, has_gpu,
                                             dali.sample)
    report["throughput"] = probe(quick) if has_gpu and probe_too else None
    counts = report["tests"]["counts"]
    ok = has_gpu and report["tests"]["exit_code"] == 0 and counts["passed"] > 0 and \
        not counts["failed"] and not counts["error"]
    report["verdict"] = "ok" if ok else ("no CUDA GPU" if not has_gpu else "failed")
    return report, 0 if ok else (2 if not has_gpu else 1)


def format_report(report: dict) -> str:
    env, tests = report["environment"], report["tests"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gb']} GB)" for g in env["gpus"]) or "none"
    lines = [f"GPUs: {gpus}; torch {env['versions']['torch']}, CUDA {env['cuda']}, "
             f"Python {env['python']}",
             f"gpu tests: {tests['counts']} in {tests['seconds']} s"]
    lines += [f"  {t['outcome']:<8}{t['name']}  {t['message']}" for t in tests["tests"]
              if t["outcome"] != "passed"]
    from app.bench.dali_reserve import format_lines  # noqa: PLC0415
    lines += format_lines(report["dali_memory"])
    if report["throughput"]:
        from app.bench.model import format_report as model_report  # noqa: PLC0415
        lines.append(model_report(report["throughput"]))
    lines.append(f"verdict: {report['verdict']}")
    return "\n".join(lines)

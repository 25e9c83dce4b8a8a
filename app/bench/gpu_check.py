"""`bin/bench.py gpu-check`: a GPU box proved end to end within the time budget its user
chooses. Its parts, in their order of value, run by app/bench/part_runner.py: a new measurement
is one more entry in `parts()`.

The deadlines of the parts before the gpu tests, STOP_S and the tests' reserved slice add up to
600 s, so in any budget from there each gets its whole deadline even if every part before it
runs to its own; what a budget holds beyond every part's deadline goes to the gpu tests. The
extras run after the tests, on what the parts before them left unused. `prepare` fills the
compile cache every later part shares, so that each loads its graphs rather than compiling
them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from app.bench import reports
from app.bench.part_runner import REPO, Part, Paths, part_environment, run_parts, sized
from app.bench.probe import check_requirements

DATA = ("--dataset", "sample_bench")
RESNET = ("-a", "resnet50", "-b", "256")
# one short epoch: 40 classes of the bench sample (4,800 train, 400 val images), nvJPEG
TRAIN = (*DATA, *RESNET, "--image-size", "224", "--classes", "40", "--epochs", "1", "-p", "1",
         "--decoder", "nvjpeg")
TWO_WORKERS = ("--devices", "cuda:0,cuda:0", "-j", "6", "--check-every", "1")
# the default: every part its whole deadline, the gpu tests ~15 minutes (with 4 processes they
# took longer than 7 minutes on an H100)
BUDGET_S = 1800.0
TESTS_S = 115.0  # the gpu tests' slice, reserved
WORK = Path(tempfile.gettempdir()) / "imagenet-dp-gpu-check"  # the default --work
IMAGENETTE_CONFIG = "configs/imagenette_128_5.toml"
TARGET = 0.8577  # the leaderboard's top-1 for 128 px, 5 epochs
GPU_MARK = re.compile(r"pytest\.mark\.gpu2?\b")
TEST_TIMEOUT_S = 60  # each gpu test's: one that hangs must leave the others most of the slice


@dataclass(frozen=True)
class Options:
    """What a user sets of the parts."""
    test_processes: int = 4
    select: str = ""
    dali_threads: int = 8
    dali_batch: int = 256
    dali_sample: str = "tiny"


def bench(*args: str) -> list[str]:
    return [sys.executable, str(REPO / "bin" / "bench.py"), *args]


def driver(paths: Paths, name: str, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "bin" / "driver.py"), *args, "--output-dir",
            str(paths.runs), "--run-name", name]


def imagenette_row() -> list[str]:
    """Imagenette's leaderboard row (fastai/imagenette: 85.77% top-1, the mean of 5 runs) as
    `peers` flags: ours with the row's config, its model and batch size taken from it (one
    place says the recipe), pytorch/examples' recipe on torchvision's ResNet-50 (it has no
    SE-ResNeXt); the user's copy (the catalog's imagenette_local) or fast.ai's archive."""
    from app.config.sources import file_overrides, make_config  # noqa: PLC0415
    config = make_config(file_overrides(str(REPO / IMAGENETTE_CONFIG)))
    return ["peers", "--dataset", "imagenette_local" if os.environ.get("IMAGENETTE_ROOT")
            else "imagenette", "--config", IMAGENETTE_CONFIG, "-a", config.model.arch,
            "--peer-arch", "resnet50", "--image-size", "128", "-b", str(config.train.batch_size),
            "--epochs", "5", "-j", "12", "--device", "cuda:0", "--trainers", "ours,examples",
            "--seeds", "0,1,2"]


def run_figures(paths: Paths, name: str) -> dict | None:
    """A driver run's figures, from its metrics.jsonl (medians over the print intervals after
    the first, which compiles)."""
    metrics = paths.runs / name / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    intervals = [r for r in rows if "train/images_per_sec" in r][1:]
    epochs = [r for r in rows if "val/top1" in r]
    compiled = [r["compile/first_step_s"] for r in rows if "compile/first_step_s" in r]
    return {"finished": bool(epochs), "steps": max((r["step"] for r in rows), default=0),
            **{field: statistics.median(r[key] for r in intervals) if intervals else None
               for field, key in (("images_per_s", "train/images_per_sec"),
                                  ("data_wait", "train/data_wait"))},
            "compile_first_step_s": compiled[0] if compiled else None,
            "epoch_time_s": epochs[-1]["epoch/time_s"] if epochs else None,
            "skipped": epochs[-1]["train/skipped"] + epochs[-1]["val/skipped"] if epochs
            else None}


def gpu_test_files() -> list[str]:
    """The test files that hold gpu tests: the others are not collected (some import packages
    a GPU box may lack, and collecting them all in each test process costs much)."""
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").glob("test_*.py")
                  if GPU_MARK.search(path.read_text()))


def gpu_tests_command(junit_xml: Path, processes: int, select: str) -> list[str]:
    """pytest over the gpu tests; with pytest-xdist, `processes` share the GPU (most tests are
    driver runs that leave it idle while they start)."""
    # a file that needs a package the machine lacks must not stop the collection of the others
    argv = [sys.executable, "-m", "pytest", "-m", "gpu or gpu2", "-p", "no:cacheprovider", "-v",
            "--continue-on-collection-errors", f"--junitxml={junit_xml}", *gpu_test_files()]
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv.append(f"--timeout={TEST_TIMEOUT_S}")
    if processes > 1 and importlib.util.find_spec("xdist") is not None:
        argv += ["-n", str(processes)]
    if select:
        argv += ["-k", select]
    return argv


def gpu_test_figures(paths: Paths, name: str) -> dict | None:
    """Each gpu test and how it ended, and the counts per outcome, from pytest's JUnit XML;
    pytest killed at the deadline writes none, and its -v log (<part>.log) says which tests
    ended and how."""
    junit_xml, tests = paths.out / f"{name}.xml", []
    if not junit_xml.exists():
        return None
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
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
    return {"counts": dict(Counter(test["outcome"] for test in tests)), "tests": tests}


# Deadlines in s (the module's docstring says how they add up).
def parts(o: Options = Options()) -> list[Part]:
    """Every part, in its order of value."""
    return [
        Part("probe", "versions, GPU, memory", 30, lambda p: [
            sys.executable, "-m", "app.bench.probe", "--json", str(p.report("probe"))],
             summary=reports.probe),
        Part("imagenette", f"Imagenette's row, 128 px 5 epochs (target top-1 {TARGET}): the "
             "2020 holder's recipe (its SE-ResNeXt, Ranger, batch 32) on IMAGENETTE_ROOT's "
             "photos or fast.ai's archive, seeds 0, 1, 2, then pytorch/examples' while a run "
             "fits", 145, lambda p: bench(*imagenette_row(), "--json",
                                          str(p.report("imagenette"))), summary=reports.peers),
        Part("prepare", "the bench sample and the compile caches: ResNet-50 by regions, 224 "
             "px, batch 256, one GPU, one short epoch", 135,
             lambda p: driver(p, "prepare", *TRAIN, "--device", "cuda:0", "-j", "12"),
             collect=run_figures, summary=reports.run),
        Part("gpus_ps", "--devices cuda:0,cuda:0 --sync ps: worker processes and the parameter "
             "server over CUDA memory, one short epoch", 55,
             lambda p: driver(p, "gpus_ps", *TRAIN, *TWO_WORKERS, "--sync", "ps"),
             collect=run_figures, summary=reports.run),
        Part("e2e", "ResNet-50 end to end per decoder (nvjpeg, pillow, dali if it imports) "
             "beside the pytorch/examples recipe and the model alone", 100,
             lambda p: bench("e2e", *DATA, *RESNET, "-j", "12", "--decoders",
                             "nvjpeg,pillow,dali", "--steps", "25", "--warmup", "5", "--json",
                             str(p.report("e2e"))), summary=reports.e2e),
        Part("gpu_tests", f"the gpu tests, fastest first, {TEST_TIMEOUT_S} s each", TESTS_S,
             lambda p: gpu_tests_command(p.out / "gpu_tests.xml", o.test_processes, o.select),
             collect=gpu_test_figures, summary=reports.gpu_tests,
             env={"IMAGENET_DP_TESTS_FASTEST_FIRST": "1"}, reserved_s=TESTS_S, grows=True),
        # the extras: on whatever the parts above left unused
        Part("gpus_allreduce", "--devices cuda:0,cuda:0 --sync allreduce, one short epoch", 55,
             lambda p: driver(p, "gpus_allreduce", *TRAIN, *TWO_WORKERS, "--sync", "allreduce"),
             collect=run_figures, summary=reports.run),
        # compiled by regions, as the trainer compiles; no 1-worker mode: two workers share the
        # one GPU, so one worker's step is no baseline
        Part("sync", "the gradient sync's overlap with backward (by regions): ps, allreduce", 45,
             lambda p: bench("sync", *RESNET, "--image-size", "224", "--devices",
                             "cuda:0,cuda:0", "--compile", "regions", "--modes", "ps,allreduce",
                             "--steps", "10", "--warmup", "3", "--json", str(p.report("sync"))),
             summary=reports.sync),
        Part("dali_memory", "what each DALI pipeline (train, then val) reserves at build and at "
             "its first batch, beside the formula", 45, lambda p: [
                 sys.executable, "-m", "app.bench.dali_reserve", "--json",
                 str(p.report("dali_memory")), "--threads", str(o.dali_threads),
                 "--batch-size", str(o.dali_batch), "--sample", o.dali_sample],
             summary=reports.dali),
        Part("model", "ResNet-50 model only, 224 px, batch 256: ours compiled whole and eager "
             "beside the pytorch/examples numerics", 120,
             lambda p: bench("model", *RESNET, "--steps", "20", "--warmup", "5", "--json",
                             str(p.report("model"))), summary=reports.model),
        Part("start", "what starting a run costs here: 1 and 2 workers on one GPU (ps), 6 "
             "loader processes each, and a restart after a killed worker", 120,
             lambda p: bench("start", "--device", "cuda:0", "--workers", "1,2", "-j", "6",
                             "--sync", "ps", "--restart", "--repeats", "1", "--json",
                             str(p.report("start"))), summary=reports.start),
    ]


def chosen(names: str, budget_s: float, options: Options = Options()) -> list[Part]:
    """The parts named (comma-separated; all for "") in their order of value, sized to the
    budget."""
    every, wanted = parts(options), {name for name in names.split(",") if name}
    unknown = wanted - {part.name for part in every}
    if unknown:
        raise ValueError(f"unknown parts {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(part.name for part in every)}")
    return sized([part for part in every if not wanted or part.name in wanted], budget_s)


def verdict(outcomes: list[dict]) -> tuple[str, int]:
    """(verdict, exit code): "no CUDA GPU" (2) when the probe found none; "ok" (0) when every
    part ended well and, where the gpu tests ran, at least one passed (all skipped proves
    nothing); else "failed" (1)."""
    figures = {o["name"]: o["figures"] for o in outcomes}
    if (figures.get("probe") or {}).get("gpus") == []:
        return "no CUDA GPU", 2
    tests_passed = "gpu_tests" not in figures or \
        bool((figures["gpu_tests"] or {}).get("counts", {}).get("passed"))
    if tests_passed and all(o["status"] == "ok" for o in outcomes):
        return "ok", 0
    return "failed", 1


def run(parts: list[Part], budget_s: float, out: Path, work: Path,
        archive: Path | None = None) -> dict:
    """The report: every part's outcome, the verdict and its exit code."""
    check_requirements()
    paths = Paths(out, work, archive)
    outcomes = run_parts(parts, budget_s, paths, part_environment(paths))
    said, code = verdict(outcomes)
    return {"parts": outcomes, "summary": str(out / "summary.md"), "verdict": said,
            "exit_code": code}

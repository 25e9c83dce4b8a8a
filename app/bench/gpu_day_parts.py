"""gpu-day's parts, in their order of value: a new measurement is one more entry in PARTS.

How the 510 s of a device call's budget are shared out (docs/benchmarks.md has the estimate
per part). The issue's parts come first, in its order of value: the probe (seconds, and it
says what the machine is even if nothing else runs); the common first step, one short driver
run that generates the bench sample and compiles ResNet-50 by regions at 224 px, batch 256
(train and eval graphs) into the compile cache every later part shares, so that each of them
loads its graphs rather than compiling them (a fresh compile is about a minute); the
`--gpus`-style runs; end to end per decoder; the sync modes by regions; then the gpu tests,
whose slice the runner reserves. Their deadlines, the time to kill the last part before the
tests and the tests' slice add up to the budget, so each gets its whole deadline even if every
part before it runs to its own. The extras (the optimizer-step grid, the sync modes compiled
whole, threads vs processes) come after the tests and run on what the parts before them left
unused.

What costs most was trimmed: the `--gpus`-style runs train one epoch of 40 classes (4,800
images) with a checksum comparison after every step; the end-to-end runs measure the peer and
the model alone once for all decoders; the sync modes run without the 1-worker mode (two
workers share the one GPU, so one worker's step is no baseline for theirs); the whole-model
compile (a fresh one, about a minute in each worker) and the threads rows are extras; the
optimizer-step grid runs eagerly and without the peer's row (the step does not depend on the
compile; the peer's fp32 cuDNN autotuning alone took 21 s); the gpu tests run fastest first,
each with its own timeout. Parts that write JSON figures write them after each row, so a part
killed at its deadline keeps the rows that finished.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from app.bench.gpu_check import gpu_test_files, parse_junit
from app.bench.gpu_day import REPO, Part, Paths, format_report, part_environment, run_parts

PYTHON = sys.executable
DATA = ("--dataset", "sample_bench")
RESNET = ("-a", "resnet50", "-b", "256")
# one short epoch: 40 classes of the bench sample (4,800 train, 400 val images), nvJPEG
TRAIN = (*DATA, *RESNET, "--image-size", "224", "--classes", "40", "--epochs", "1", "-p", "1",
         "--decoder", "nvjpeg")
TWO_WORKERS = ("--devices", "cuda:0,cuda:0", "-j", "6", "--check-every", "1")
BUDGET_S = 510.0  # bin/bench.py gpu-day's default: with pip and a killed part's STOP_S, ~540 s
TESTS_S = 70.0  # the gpu tests' slice, reserved
TEST_TIMEOUT_S = 60  # each test's: one that hangs must leave the others most of the slice


def bench(*args: str) -> list[str]:
    return [PYTHON, str(REPO / "bin" / "bench.py"), *args]


def driver(paths: Paths, name: str, *args: str) -> list[str]:
    return [PYTHON, str(REPO / "bin" / "driver.py"), *args, "--output-dir", str(paths.runs),
            "--run-name", name]


# --- figures of a driver run, from its metrics.jsonl ------------------------------------------

def run_figures(paths: Paths, name: str) -> dict | None:
    metrics = paths.runs / name / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    intervals = [r for r in rows if "train/images_per_sec" in r][1:]  # the first compiles
    epochs = [r for r in rows if "val/top1" in r]
    compiled = [r["compile/first_step_s"] for r in rows if "compile/first_step_s" in r]
    return {"finished": bool(epochs), "steps": max((r["step"] for r in rows), default=0),
            "images_per_s": median(r["train/images_per_sec"] for r in intervals),
            "data_wait": median(r["train/data_wait"] for r in intervals),
            "compile_first_step_s": compiled[0] if compiled else None,
            "epoch_time_s": epochs[-1]["epoch/time_s"] if epochs else None,
            "skipped": epochs[-1]["train/skipped"] + epochs[-1]["val/skipped"] if epochs
            else None}


def median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def run_lines(f: dict) -> list[str]:
    return [f"- finished its epoch (evaluated, saved): {'yes' if f['finished'] else 'no'}, "
            f"{f['steps']} steps; replica checksums compared after every step (a drift ends "
            "the run with an error)",
            f"- images/s (median of the steps after the first): {number(f['images_per_s'])}; "
            f"data wait {percent(f['data_wait'])}",
            f"- first compiled step: {number(f['compile_first_step_s'], 1)} s; epoch "
            f"{number(f['epoch_time_s'], 1)} s; images skipped: {f['skipped']}"]


def number(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


# --- the other parts' summaries, from their own JSON ---------------------------------------

def probe_lines(f: dict) -> list[str]:
    gpus = ", ".join(f"{g['name']} ({g['total_gb']} GB, {g['free_gb']} GB free)"
                     for g in f["gpus"]) or "none"
    versions = f["versions"]
    return [f"- GPUs: {gpus}; {f['cpu_count']} CPU cores",
            f"- Python {f['python']}, torch {versions['torch']}, torchvision "
            f"{versions['torchvision']}, CUDA {f['cuda']}; DALI "
            f"{'imports' if f['dali_imports'] else 'does not import'}"]


def e2e_lines(f: dict) -> list[str]:
    """The rows that finished (the ratios once the model alone was measured)."""
    lines = ["| run | images/s | vs peer | of model only | CPU cores |",
             "| --- | --- | --- | --- | --- |"]
    for r in f["results"]:
        if "skipped" in r:
            lines.append(f"| {r['label']} | skipped: {r['skipped']} | | | |")
            continue
        lines.append(f"| {r['label']} | {number(r['images_per_s'])} | "
                     f"{number(r.get('ratio_to_peer'), 2)} | "
                     f"{percent(r.get('share_of_model_only'))} | {r['cpu_cores']:.1f} |")
    model_only = f["model_only"]
    return lines + ["", "model only, our settings: "
                    f"{number(model_only['images_per_s'] if model_only else None)} img/s"]


def sync_lines(f: dict) -> list[str]:
    lines = ["| mode | step | images/s |", "| --- | --- | --- |"]
    lines += [f"| {r['label']} | {r['step_time_s'] * 1000:.1f} ms | {r['images_per_s']:,.0f} |"
              for r in f["results"]]
    if f["ps_over_allreduce"] is not None:
        lines += ["", f"ps / allreduce step time: {f['ps_over_allreduce']:.3f}"]
    return lines


def model_lines(f: dict) -> list[str]:
    lines = ["| batch | size | step | images/s | vs largest size | vs first step |",
             "| --- | --- | --- | --- | --- | --- |"]
    return lines + [f"| {r['batch_size']} | {r['image_size']} | {r['optimizer_step']} | "
                    f"{number(r['images_per_s'])} | {number(r['speed_vs_largest'], 2)} | "
                    f"{number(r['speed_vs_first_step'], 3)} |"
                    for r in f.get("sizes", {"results": []})["results"]]


def threads_lines(f: dict) -> list[str]:
    if "skipped" in f:
        return [f"- skipped: {f['skipped']}"]
    lines = ["| replicas as | images/s |", "| --- | --- |"]
    lines += [f"| {r['mode']} | {r['images_per_s']:,.0f} |" for r in f["results"]]
    return lines + ["", f"threads / processes: {number(f['threads_over_processes'], 3)}"]


def threads_bench(paths: Paths, name: str, devices: str) -> list[str]:
    # both modes eager (threads cannot compile), one epoch of the bench sample per mode
    return bench("threads", "-a", "resnet50", "-b", "128", "--image-size", "224", "--devices",
                 devices, *DATA, "-j", "6", "--json", str(paths.report(name)))


# --- the gpu tests, as they end --------------------------------------------------------------

VERBOSE_LINE = re.compile(r"^(tests/\S.*?::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def test_figures(paths: Paths, name: str) -> dict:
    """From the JUnit XML when pytest finished, else from its -v log (cut off at the
    deadline): each test that ended and how."""
    xml = paths.out / f"{name}.xml"
    if xml.exists():
        tests = [{"name": t["name"], "outcome": t["outcome"]} for t in parse_junit(xml)]
    else:
        log = (paths.out / f"{name}.log").read_text(errors="replace")
        tests = [{"name": m[1], "outcome": m[2].lower()} for m in
                 (VERBOSE_LINE.match(line) for line in log.splitlines()) if m]
    counts: dict[str, int] = {}
    for test in tests:
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    return {"counts": counts, "tests": tests}


def test_lines(f: dict) -> list[str]:
    counts = ", ".join(f"{n} {outcome}" for outcome, n in f["counts"].items())
    lines = [f"- {counts or 'none ended'}"]
    return lines + [f"- {t['outcome']}: {t['name']}" for t in f["tests"]
                    if t["outcome"] not in ("passed", "skipped")]


def gpu_tests(paths: Paths) -> list[str]:
    # a file that needs a package the machine lacks must not stop the others
    return [PYTHON, "-m", "pytest", "-m", "gpu or gpu2", "-p", "no:cacheprovider", "-v",
            "--continue-on-collection-errors", f"--timeout={TEST_TIMEOUT_S}",
            f"--junitxml={paths.out / 'gpu_tests.xml'}", *gpu_test_files()]


def sync_bench(paths: Paths, name: str, compile: str) -> list[str]:
    # ps and allreduce only: two workers share the one GPU, so one worker's step is no
    # baseline for theirs
    return bench("sync", *RESNET, "--image-size", "224", "--devices", "cuda:0,cuda:0",
                 "--compile", compile, "--modes", "ps,allreduce", "--steps", "10", "--warmup",
                 "3", "--json", str(paths.report(name)))


# Deadlines in s. The parts before gpu_tests, the time to kill the last of them (STOP_S) and
# the tests' reserved slice add up to BUDGET_S: each gets its whole deadline even if every one
# before it runs to its own (tests/test_gpu_day.py checks).
PARTS = [
    Part("probe", "versions, GPU, memory", 30,
         lambda p: [PYTHON, "-m", "app.bench.probe", "--json", str(p.report("probe"))],
         summary=probe_lines),
    Part("prepare", "the bench sample and the compile caches: ResNet-50 by regions, 224 px, "
         "batch 256, one GPU, one short epoch", 135,
         lambda p: driver(p, "prepare", *TRAIN, "--device", "cuda:0", "-j", "12"),
         collect=run_figures, summary=run_lines),
    Part("gpus_ps", "--devices cuda:0,cuda:0 --sync ps: worker processes and the parameter "
         "server over CUDA memory, one short epoch", 55,
         lambda p: driver(p, "gpus_ps", *TRAIN, *TWO_WORKERS, "--sync", "ps"),
         collect=run_figures, summary=run_lines),
    Part("gpus_allreduce", "--devices cuda:0,cuda:0 --sync allreduce, one short epoch", 55,
         lambda p: driver(p, "gpus_allreduce", *TRAIN, *TWO_WORKERS, "--sync", "allreduce"),
         collect=run_figures, summary=run_lines),
    Part("e2e", "ResNet-50 end to end per decoder (nvjpeg, pillow, dali if it imports) beside "
         "the pytorch/examples recipe and the model alone", 100,
         lambda p: bench("e2e", *DATA, *RESNET, "-j", "12", "--decoders", "nvjpeg,pillow,dali",
                         "--steps", "25", "--warmup", "5", "--json", str(p.report("e2e"))),
         summary=e2e_lines),
    Part("sync_regions", "sync overlap compiled by regions: ps, allreduce", 45,
         lambda p: sync_bench(p, "sync_regions", "regions"), summary=sync_lines),
    Part("gpu_tests", f"the gpu tests, fastest first, {TEST_TIMEOUT_S} s each", TESTS_S,
         gpu_tests, collect=test_figures, summary=test_lines,
         env={"IMAGENET_DP_TESTS_FASTEST_FIRST": "1"}, reserved_s=TESTS_S),
    # the extras: on whatever the parts above left unused
    Part("model_steps", "the optimizer step foreach vs fused at 160/192/224 px, batch 256 and "
         "512 (eager, without the peer)", 75,
         lambda p: bench("model", *RESNET, "--no-compile", "--no-peer", "--sizes",
                         "160,192,224", "--batch-sizes", "256,512", "--optimizer-steps",
                         "foreach,fused", "--steps", "15", "--warmup", "3", "--json",
                         str(p.report("model_steps"))),
         summary=model_lines),
    Part("sync_whole", "sync overlap compiled whole: ps, allreduce", 120,
         lambda p: sync_bench(p, "sync_whole", "whole"), summary=sync_lines),
    Part("threads", "replicas as threads vs as processes (the Python API), two on one GPU, "
         "both eager, one epoch of the bench sample each", 90,
         lambda p: threads_bench(p, "threads", "cuda:0,cuda:0"), summary=threads_lines),
    Part("threads_per_gpu", "the same with a replica per GPU of the machine (skipped with "
         "one)", 90, lambda p: threads_bench(p, "threads_per_gpu", "all"),
         summary=threads_lines),
]


def by_name(names: str) -> list[Part]:
    """The parts named (comma-separated), in PARTS' order; all for an empty string."""
    wanted = {name for name in names.split(",") if name}
    unknown = wanted - {part.name for part in PARTS}
    if unknown:
        raise ValueError(f"unknown parts {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(part.name for part in PARTS)}")
    return [part for part in PARTS if not wanted or part.name in wanted]


def run(budget_s: float, out: Path, work: Path, names: str = "",
        archive: Path | None = None) -> tuple[dict, int]:
    """bin/bench.py gpu-day: the report (every part's outcome) and the exit code (0: every
    part ran and ended well)."""
    paths = Paths(out, work, archive)
    outcomes = run_parts(by_name(names), budget_s, paths, part_environment(paths))
    code = 0 if all(o["status"] == "ok" for o in outcomes) else 1
    return {"parts": outcomes, "summary": str(out / "summary.md")}, code


__all__ = ["PARTS", "by_name", "run", "format_report"]

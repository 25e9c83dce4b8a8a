"""What each gpu-check part's figures say, as markdown lines for summary.md: the figures of a
driver run (from its metrics.jsonl) and of each bench (from the JSON it writes)."""

from __future__ import annotations

import json
import statistics

from app.bench.part_runner import Paths


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
    lines = ["| setting | images/s | vs peer | first step | peak GB |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['label']} | {number(r['images_per_s'])} | {number(r.get('ratio_to_peer'), 2)} "
              f"| {number(r['first_step_s'], 1)} s | {number(r['peak_memory_gb'], 1)} |"
              for r in f["results"]]
    grid = f.get("sizes", {"results": []})["results"]
    if not grid:
        return lines
    lines += ["", "| batch | size | step | images/s | vs largest size | vs first step |",
              "| --- | --- | --- | --- | --- | --- |"]
    return lines + [f"| {r['batch_size']} | {r['image_size']} | {r['optimizer_step']} | "
                    f"{number(r['images_per_s'])} | {number(r['speed_vs_largest'], 2)} | "
                    f"{number(r['speed_vs_first_step'], 3)} |" for r in grid]


def dali_lines(f: dict) -> list[str]:
    lines = [f"- at {f['threads']} threads, batch {f['batch_size']}, the {f['sample']} sample "
             f"({f['formula']}):"]
    for split, want in f["expected"].items():
        line = (f"- {split}: expected GPU {mib(want['gpu_bytes'])}, pinned "
                f"{mib(want['pinned_bytes'])} ({want['threads']} threads)")
        got = (f["measured"] or {}).get(split)
        if got:
            line += (f"; measured at build: GPU {mib(got['build'].get('gpu_bytes'))}, host RSS "
                     f"{mib(got['build'].get('host_rss_bytes'))}; first batch: GPU "
                     f"{mib(got['first_batch'].get('gpu_bytes'))}; preallocated for "
                     f"{got.get('preallocation_hint')}")
        lines.append(line)
    if f["why_not"]:
        lines.append(f"- not measured: {f['why_not']}")
    return lines


def mib(count: int | None) -> str:
    return "n/a" if count is None else f"{count / 2**20:,.0f} MiB"


def start_lines(f: dict) -> list[str]:
    return [f"- {row['label']}: {row['median_cpu_s']:.1f} CPU-s, first step after "
            f"{row['median_first_step_s']:.1f} s" for row in f.get("rows", [])]


def imagenette_lines(f: dict) -> list[str]:
    if "skipped" in f:
        return [f"- skipped: {f['skipped']}"]
    epochs, target = f["setup"]["epochs"], f["target"]
    lines = [f"| trainer | seed | top-1 after epoch {epochs} | wall | time to {target} |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['trainer']} | {r['seed']} | {r['top1']:.4f}"
              + ("" if len(r["epoch_top1"]) == epochs else
                 f" (after {len(r['epoch_top1'])} epochs)")
              + f" | {r['wall_s']:.0f} s | {reached_in(r['time_to_target_s'])} |"
              for r in f["runs"]]
    for trainer, row in f["summary"].items():
        lines.append(f"- {trainer}: top-1 {row['top1_mean']:.4f} (min {row['top1_min']:.4f}, "
                     f"max {row['top1_max']:.4f}) over {row['seeds']} seed(s), target "
                     f"{target}; {row['wall_s_mean']:.0f} s a run")
    return lines + [f"- not run, it would not end within the part's deadline: {r['trainer']} "
                    f"seed {r['seed']} (~{r['expected_s']:.0f} s, {r['left_s']:.0f} s left)"
                    for r in f.get("not_run", [])]


def reached_in(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.0f} s"

"""How every bench report reads: markdown lines, printed by bin/bench.py and gathered by
gpu-check into summary.md (one reading of a report, wherever it is shown). Imports nothing
heavy: gpu-check's runner formats its parts' figures without torch."""

from __future__ import annotations

from typing import Iterable


def table(header: str, rows: Iterable[Iterable]) -> list[str]:
    """A markdown table: `header`'s columns "|"-separated, each row's cells as given."""
    names = header.split("|")
    return ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def number(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def mib(count: int | None) -> str:
    return "n/a" if count is None else f"{count / 2**20:,.0f} MiB"


def e2e(f: dict) -> list[str]:
    """The rows that finished (the ratios once the model alone was measured)."""
    s = f["setup"]
    rows = [(r["label"], f"skipped: {r['skipped']}", "", "", "", "") if "skipped" in r else
            (r["label"], number(r["images_per_s"], 1), number(r.get("ratio_to_peer"), 2),
             percent(r.get("share_of_model_only")), number(r["cpu_cores"], 1),
             number(r["peak_memory_gb"], 1)) for r in f["results"]]
    alone = f["model_only"]["images_per_s"] if f["model_only"] else None
    return [f"end to end: {s['arch']}, batch {s['batch_size']}, {s['image_size']} px, "
            f"{s['dataset']}, {s['workers']} loader processes, {s['device']}", "",
            *table("run|images/s|vs peer|of model only|CPU cores|peak GB", rows), "",
            f"model only, our settings: {number(alone, 1)} img/s"]


def model(f: dict) -> list[str]:
    first = f["results"][0]
    lines = [f"model only: {first['arch']}, batch {first['batch_size']}, {first['image_size']} "
             f"px, {first['device']}", "", *table(
                 "setting|images/s|vs peer|first step|peak GB",
                 ((r["label"], number(r["images_per_s"], 1), number(r["ratio_to_peer"], 2),
                   f"{r['first_step_s']:.1f} s", number(r["peak_memory_gb"], 1))
                  for r in f["results"]))]
    extra = f.get("batch_augment")
    if extra:
        lines += ["", f"batch augment (erase {extra['random_erase']:g}, mixup "
                  f"{extra['mixup_alpha']:g}, cutmix {extra['cutmix_alpha']:g}) alone: "
                  f"{extra['ms_per_step']:.2f} ms per batch, "
                  f"{extra['share_of_plain_step']:.1%} of the first setting's step"]
    steps = f.get("optimizers", []) + ([f["ema"]] if "ema" in f else [])
    if steps:
        lines += ["", *table("step|images/s|step ms|vs the first setting's", (
            (r["label"], number(r["images_per_s"], 1), number(r["step_ms"], 1),
             number(r["step_vs_plain"], 3)) for r in steps))]
    sizes = f.get("sizes")
    if sizes:
        kind = sizes["results"][0]["optimizer_step"]
        lines += ["", f"by batch, image size and optimizer step ({sizes['setting']}):", "",
                  *table(f"batch|size|step|images/s|step ms|vs largest|pixels ratio|vs {kind}", (
                      (r["batch_size"], r["image_size"], r["optimizer_step"],
                       number(r["images_per_s"], 1), number(r["step_ms"], 1),
                       number(r["speed_vs_largest"], 2), number(r["pixels_vs_largest"], 2),
                       number(r["speed_vs_first_step"], 3)) for r in sizes["results"]))]
    return lines


def loader(f: dict) -> list[str]:
    peer = f["peer"]
    rows = [(peer["dataset"], "-", peer["decoder"], "off", number(peer["images_per_s"], 1),
             "", "", "", number(peer["cpu_cores"], 1), number(peer["cpu_ms_per_image"], 2),
             "", "", "", "")] if peer else []
    rows += [(r["dataset"], r["reader"], r["decoder"], r["auto_augment"],
              number(r["images_per_s"], 1), number(r.get("ratio_to_peer"), 2),
              number(r["ratio_to_first"], 2), number(r["ratio_to_plain"], 2),
              number(r["cpu_cores"], 1), number(r["cpu_ms_per_image"], 2),
              number(r["gets_per_s"], 1), number(r["cpu_ms_per_get"], 2),
              number(r["cpu_per_get_vs_baseline"], 2), number(r["first_batch_s"], 2))
             for r in f["results"]]
    return [f"loader only (read + decode + augment, batches on {f['device']}), batch "
            f"{f['batch_size']}, {f['workers']} loader processes, {f['image_size']} px, "
            f"{f['batches']} batches; the reader alone: client CPU per GET, no cache", "",
            *table("dataset|reader|decoder|augment|images/s|vs peer|vs first|vs plain|cores|"
                   "CPU ms/img|GETs/s|CPU ms/GET|vs base|1st batch s", rows)]


def sync(f: dict) -> list[str]:
    lines = [f"{f['arch']} ({f['gradient_mb']:.0f} MB of gradients), batch "
             f"{f['batch_per_worker']} per worker, {f['image_size']} px, devices "
             f"{','.join(f['devices'])}, compile {f['compile']}, median of {f['steps']} steps",
             "", *table("mode|step|images/s", ((r["label"], f"{r['step_time_s'] * 1000:.1f} ms",
                                                number(r["images_per_s"], 1))
                                               for r in f["results"]))]
    if f["ps_over_allreduce"] is not None:
        lines += ["", f"ps / allreduce step time: {f['ps_over_allreduce']:.3f}"]
    return lines


def start_row(row: dict) -> tuple:
    def spread(key: str) -> str:
        return "-".join(f"{f(run[key] for run in row['runs']):.1f}" for f in (min, max))
    return (row["label"], row["version"], f"{row['median_cpu_s']:.1f} ({spread('cpu_s')})",
            f"{row['median_first_step_s']:.1f} ({spread('first_step_s')})",
            f"{row['median_wall_s']:.1f}")


def start(f: dict) -> list[str]:
    s = f["setup"]
    return [f"start: {s['dataset']}, -a {s['arch']}, {s['image_size']} px, -b {s['batch_size']} "
            f"per worker, {s['epochs']} epoch(s); the machine's CPU seconds from /proc/stat, "
            "medians (min-max); restart rows: from the kill", "",
            *table("run|checkout|CPU s|first step s|wall s", map(start_row, f["rows"]))]


def peers(f: dict) -> list[str]:
    """Each trainer over its seeds, then each run; the runs left out for want of time."""
    s, target = f["setup"], f["target"]
    models = s["arch"] + (f" (peers: {s['peer_arch']})" if s.get("peer_arch") else "")
    at = "|runs at target|time to it" if target else ""
    lines = [f"{models}, {s['image_size']} px, {s['epochs']} epochs, batch {s['batch_size']}, "
             f"-j {s['workers']}, {f['root']}; the peers' recipes: " + (
                 "timm's train.py ours, main.py its own" if s.get("peer_recipe") == "ours"
                 else "each its own default"), "",
             *table(f"trainer|seeds|top-1 mean|min-max|wall s|wall vs first|train img/s{at}", (
                 (name, r["seeds"], f"{r['top1_mean']:.4f}",
                  f"{r['top1_min']:.4f}-{r['top1_max']:.4f}", number(r["wall_s_mean"]),
                  f"{r['wall_vs_first']:.2f}x", number(r.get("train_images_per_s_mean"), 1),
                  *((r["runs_at_target"], number(r["time_to_target_s_mean"]) if
                     r["runs_at_target"] else "-") if target else ()))
                 for name, r in f["summary"].items())), ""]
    lines += table(f"trainer|seed|top-1 after epoch {s['epochs']}|wall|time to {target}", (
        (r["trainer"], r["seed"], f"{r['top1']:.4f}" + (
            "" if len(r["epoch_top1"]) == s["epochs"] else
            f" (after {len(r['epoch_top1'])} epochs)"), f"{r['wall_s']:.0f} s",
         "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f} s")
        for r in f["runs"]))
    return lines + [f"- not run, it would not end within the part's deadline: {r['trainer']} "
                    f"seed {r['seed']} (~{r['expected_s']:.0f} s, {r['left_s']:.0f} s left)"
                    for r in f.get("not_run", [])]


def predict(f: dict) -> list[str]:
    base = f["results"][0]["model_images_per_s"]
    return [f"predict: {f['arch']} at {f['image_size']} px, {f['images']} images, batch "
            f"{f['batch_size']}, CPU ({f['torch_threads']} torch threads), best of "
            f"{f['repeats']}", "", *table("runtime|model img/s|end to end img/s|model vs first", (
                (r["runtime"], number(r["model_images_per_s"], 1),
                 number(r["e2e_images_per_s"], 1), f"{r['model_images_per_s'] / base:.2f}x")
                for r in f["results"])), "",
            f"logits differ by at most {f['max_logit_difference']:.2e}; top-1 agrees on "
            f"{f['top1_agreement']:.1%} of the images"]


def gpu_check(f: dict) -> list[str]:
    return [*table("part|status|seconds", ((o["name"], o["status"], f"{o['seconds']:.0f}")
                                         for o in f["parts"])),
            "", f"summary: {f['summary']}", f"verdict: {f['verdict']}"]


# gpu-check's own parts: a driver run's figures, the machine, the gpu tests, DALI's memory
def run(f: dict) -> list[str]:
    return [f"- finished its epoch (evaluated, saved): {'yes' if f['finished'] else 'no'}, "
            f"{f['steps']} steps; replica checksums compared after every step (a drift ends "
            "the run with an error)",
            f"- images/s (median of the steps after the first): {number(f['images_per_s'])}; "
            f"data wait {percent(f['data_wait'])}",
            f"- first compiled step: {number(f['compile_first_step_s'], 1)} s; epoch "
            f"{number(f['epoch_time_s'], 1)} s; images skipped: {f['skipped']}"]


def probe(f: dict) -> list[str]:
    gpus = ", ".join(f"{g['name']} ({g['total_gb']} GB, {g['free_gb']} GB free)"
                     for g in f["gpus"]) or "none"
    versions = f["versions"]
    return [f"- GPUs: {gpus}; {f['cpu_count']} CPU cores",
            f"- Python {f['python']}, torch {versions['torch']}, torchvision "
            f"{versions['torchvision']}, CUDA {f['cuda']}; DALI "
            f"{'imports' if f['dali_imports'] else 'does not import'}"]


def gpu_tests(f: dict) -> list[str]:
    counts = ", ".join(f"{n} {outcome}" for outcome, n in f["counts"].items())
    return [f"- {counts or 'none ended'}"] + [
        f"- {t['outcome']}: {t['name']}" + (f" ({t['message']})" if t.get("message") else "")
        for t in f["tests"] if t["outcome"] not in ("passed", "skipped")]


def dali(f: dict) -> list[str]:
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
    return lines + ([f"- not measured: {f['why_not']}"] if f["why_not"] else [])

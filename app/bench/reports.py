"""How every bench report reads: markdown, printed by bin/bench.py and gathered by gpu-check
into summary.md (one reading of a report wherever it is shown). Imports nothing heavy:
gpu-check's runner formats its parts' figures without torch."""

from __future__ import annotations

from typing import Iterable


def table(header: str, rows: Iterable[Iterable]) -> list[str]:
    """A markdown table: `header`'s columns "|"-separated, each row's cells as given."""
    names = header.split("|")
    return ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def cell(value) -> str:
    """A figure as a table shows it: "-" for none, a ratio to 3 places, the rest to 1."""
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return "-" if value is None else str(value)


def columns(rows: Iterable[dict], spec: str) -> list[str]:
    """The rows' fields as a table; `spec`: "key=header|key=header|...", in order."""
    named = dict(pair.split("=", 1) for pair in spec.split("|"))
    return table("|".join(named.values()), ([cell(row.get(key)) for key in named]
                                            for row in rows))


def number(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def mib(count: int | None) -> str:
    return "n/a" if count is None else f"{count / 2**20:,.0f} MiB"


def e2e(f: dict) -> list[str]:
    s, alone = f["setup"], (f["model_only"] or {}).get("images_per_s")
    return [f"end to end: {s['arch']}, batch {s['batch_size']}, {s['image_size']} px, "
            f"{s['dataset']}, {s['workers']} loader processes, {s['device']}", "",
            *columns(f["results"], "label=run|images_per_s=images/s|ratio_to_peer=vs peer|"
                     "share_of_model_only=of model only|cpu_cores=CPU cores|"
                     "peak_memory_gb=peak GB|skipped=skipped"),
            "", f"model only, our settings: {number(alone, 1)} img/s"]


def model(f: dict) -> list[str]:
    first, extra, sizes = f["results"][0], f.get("batch_augment"), f.get("sizes")
    steps = f.get("optimizers", []) + ([f["ema"]] if "ema" in f else [])
    lines = [f"model only: {first['arch']}, batch {first['batch_size']}, {first['image_size']} "
             f"px, {first['device']}", "", *columns(
                 f["results"], "label=setting|images_per_s=images/s|ratio_to_peer=vs peer|"
                 "first_step_s=first step s|peak_memory_gb=peak GB")]
    if extra:
        lines += ["", f"batch augment (erase {extra['random_erase']:g}, mixup "
                  f"{extra['mixup_alpha']:g}, cutmix {extra['cutmix_alpha']:g}) alone: "
                  f"{extra['ms_per_step']:.2f} ms per batch, "
                  f"{extra['share_of_plain_step']:.1%} of the first setting's step"]
    if steps:
        lines += ["", *columns(steps, "label=step|images_per_s=images/s|step_ms=step ms|"
                               "step_vs_plain=vs the first setting's")]
    if sizes:
        lines += ["", f"by image size ({sizes['setting']}):", "", *columns(
            sizes["results"], "image_size=size|images_per_s=images/s|step_ms=step ms|"
            "speed_vs_largest=vs largest|pixels_vs_largest=pixels ratio")]
    return lines


def loader(f: dict) -> list[str]:
    return [f"loader only, batches on {f['device']}: batch {f['batch_size']}, -j {f['workers']}, "
            f"{f['image_size']} px, {f['batches']} batches; the reader alone: no cache", "",
            *columns(([f["peer"]] if f["peer"] else []) + f["results"],
                     "dataset=dataset|reader=reader|decoder=decoder|auto_augment=augment|"
                     "images_per_s=images/s|ratio_to_peer=vs peer|ratio_to_first=vs first|"
                     "ratio_to_plain=vs plain|cpu_cores=cores|cpu_ms_per_image=CPU ms/img|"
                     "gets_per_s=GETs/s|cpu_ms_per_get=CPU ms/GET|cpu_per_get_vs_baseline="
                     "vs base|first_step_s=1st batch s")]


def sync(f: dict) -> list[str]:
    ratio = f["ps_over_allreduce"]
    return [f"{f['arch']} ({f['gradient_mb']:.0f} MB of gradients), batch "
            f"{f['batch_per_worker']} per worker, {f['image_size']} px, devices "
            f"{','.join(f['devices'])}, compile {f['compile']}, median of {f['steps']} steps",
            "", *columns(f["results"], "label=mode|step_time_s=step s|images_per_s=images/s"),
            *(["", f"ps / allreduce step time: {ratio:.3f}"] if ratio is not None else [])]


def start_row(row: dict) -> tuple:
    def spread(key: str) -> str:
        return "-".join(f"{f(run[key] for run in row['runs']):.1f}" for f in (min, max))
    return (row["label"], f"{row['median_cpu_s']:.1f} ({spread('cpu_s')})",
            f"{row['median_first_step_s']:.1f} ({spread('first_step_s')})",
            f"{row['median_wall_s']:.1f}")


def start(f: dict) -> list[str]:
    s = f["setup"]
    return [f"start: {s['dataset']}, -a {s['arch']}, {s['image_size']} px, -b {s['batch_size']} "
            f"per worker, {s['epochs']} epoch(s); medians (min-max); restarts from the kill", "",
            *table("run|machine CPU s|first step s|wall s", map(start_row, f["rows"]))]


def peers(f: dict) -> list[str]:
    """Each trainer over its seeds, then each run; the runs left out for want of time."""
    s = f["setup"]
    lines = [f"{s['arch']}" + (f" (peers: {s['peer_arch']})" if s.get("peer_arch") else "")
             + f", {s['image_size']} px, {s['epochs']} epochs, batch {s['batch_size']}, -j "
             f"{s['workers']}, {f['root']}; the peers' recipes: " + (
                 "timm's train.py ours, main.py its own" if s.get("peer_recipe") == "ours"
                 else "each its own default"), "",
             *columns(({"trainer": name, **row} for name, row in f["summary"].items()),
                      "trainer=trainer|seeds=seeds|top1_mean=top-1 mean|top1_min=min|top1_max="
                      "max|wall_s_mean=wall s|wall_vs_first=wall vs first|train_images_per_s_"
                      "mean=train img/s"), ""]
    lines += table(f"trainer|seed|top-1 after epoch {s['epochs']}|wall", (
        (r["trainer"], r["seed"], f"{r['top1']:.4f}" + (
            "" if len(r["epoch_top1"]) == s["epochs"] else
            f" (after {len(r['epoch_top1'])} epochs)"), f"{r['wall_s']:.0f} s")
        for r in f["runs"]))
    return lines + [f"- not run, it would not end within the part's deadline: {r['trainer']} "
                    f"seed {r['seed']} (~{r['expected_s']:.0f} s, {r['left_s']:.0f} s left)"
                    for r in f.get("not_run", [])]


def predict(f: dict) -> list[str]:
    return [f"predict: {f['arch']} at {f['image_size']} px, {f['images']} images, batch "
            f"{f['batch_size']}, CPU ({f['torch_threads']} torch threads), best of "
            f"{f['repeats']}", "", *columns(f["results"], "runtime=runtime|model_images_per_s="
                                              "model img/s|e2e_images_per_s=end to end img/s"),
            "", f"logits differ by at most {f['max_logit_difference']:.2e}; top-1 agrees on "
            f"{f['top1_agreement']:.1%} of the images"]


def gpu_check(f: dict) -> list[str]:
    return [*table("part|status|seconds", ((o["name"], o["status"], f"{o['seconds']:.0f}")
                                         for o in f["parts"])),
            "", f"summary: {f['summary']}", f"verdict: {f['verdict']}"]


# gpu-check's own parts: a driver run's figures, the machine, the gpu tests, DALI's memory
def run(f: dict) -> list[str]:
    wait = "n/a" if f["data_wait"] is None else f"{f['data_wait']:.0%}"
    return [f"- finished its epoch (evaluated, saved): {'yes' if f['finished'] else 'no'}, "
            f"{f['steps']} steps; replica checksums compared after every step (a drift ends "
            "the run with an error)",
            f"- images/s (median of the steps after the first): {number(f['images_per_s'])}; "
            f"data wait {wait}",
            f"- first compiled step: {number(f['compile_first_step_s'], 1)} s; epoch "
            f"{number(f['epoch_time_s'], 1)} s; images skipped: {f['skipped']}"]


def probe(f: dict) -> list[str]:
    gpus = ", ".join(f"{g['name']} ({g['total_gb']} GB, {g['free_gb']} GB free)"
                     for g in f["gpus"]) or "none"
    versions = f["versions"]
    return [f"- GPUs: {gpus}; {f['usable_cores']} CPU cores ({f['cpu']})",
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
        got = (f["measured"] or {}).get(split)
        lines.append(f"- {split}: expected GPU {mib(want['gpu_bytes'])}, pinned "
                     f"{mib(want['pinned_bytes'])} ({want['threads']} threads)" + (
                         f"; measured at build: GPU {mib(got['build'].get('gpu_bytes'))}, "
                         f"host RSS {mib(got['build'].get('host_rss_bytes'))}; first batch: "
                         f"GPU {mib(got['first_batch'].get('gpu_bytes'))}; preallocated for "
                         f"{got.get('preallocation_hint')}" if got else ""))
    return lines + ([f"- not measured: {f['why_not']}"] if f["why_not"] else [])

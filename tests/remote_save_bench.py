"""Benchmark harness for a run folder in a bucket (not a test): a ResNet-50 (23.5 M weights,
~190 MB checkpoints with SGD's momentum) trained on the tiny sample at 32 px with
`--output-dir s3://...` against moto_server on loopback, so that docs/results.md's figures
have a command that repeats them:

    python tests/remote_save_bench.py [--arch resnet50] [--batch 8] [--epochs 3]
        [--checkpoint-interval 0.5]

It reads the driver's log and metrics.jsonl as they come (stamped with this process's clock)
and prints: the checkpoint's size and each upload's seconds (the uploader's own line), the
median step time while an upload is in flight against the median of the same run's other
steps, then sends SIGTERM once the first upload has finished and a few steps more have run,
and prints the seconds to exit, the exit code and whether the bucket's last.pt is the stop's
checkpoint. Everything runs on this machine: moto_server's CPU time competes with training.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

from s3 import ACCESS_KEY, SECRET_KEY, MotoServer  # noqa: E402

UPLOADED = re.compile(r"uploaded (checkpoints/step-\d+\.pt) \(([\d.]+) MB\) .* in ([\d.]+) s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-after-upload", type=int, default=5)
    # A save mid-epoch: its upload overlaps plain steps, not the epoch's evaluation.
    parser.add_argument("--checkpoint-interval", default="0.5", help="minutes")
    # A bucket is another machine: at 19, moto_server's CPU time (it hashes and stores every
    # part) no longer competes with training's threads for these cores.
    parser.add_argument("--server-niceness", type=int, default=0)
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="remote-save-bench-"))
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "IMAGENET_DP_CACHE": str(cache)}
    server = MotoServer()
    os.setpriority(os.PRIO_PROCESS, server.process.pid, args.server_niceness)
    try:
        server.client().create_bucket(Bucket="bench")
        env["AWS_ENDPOINT_URL"] = server.endpoint
        return measure(server, args, env, cache)
    finally:
        server.stop()


def measure(server: MotoServer, args, env: dict, cache: Path) -> int:
    url = "s3://bench/runs"
    command = [sys.executable, str(TESTS.parent / "bin" / "driver.py"), "--dataset",
               "sample_tiny", "-a", args.arch, "--image-size", "32", "-b", str(args.batch),
               "-j", "0", "-p", "1", "--epochs", str(args.epochs), "--output-dir", url,
               "--run-name", "bench", "--stop-timeout", "110", "--checkpoint-interval",
               args.checkpoint_interval]
    print("$", " ".join(command[1:]), flush=True)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend(
        (time.time(), line.rstrip()) for line in process.stderr), daemon=True)
    reader.start()
    metrics = None
    deadline = time.monotonic() + 1800
    stop_after_step = None
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        uploads = uploads_in(lines)
        metrics = metrics or next((cache / "runs").glob("*/bench/metrics.jsonl"), None)
        steps = step_times(metrics)
        if uploads and stop_after_step is None and steps:
            stop_after_step = max(steps) + args.steps_after_upload
        if stop_after_step is not None and max(steps, default=0) >= stop_after_step:
            break
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=600)
    exit_s = time.monotonic() - signalled
    reader.join(timeout=10)
    report(server, uploads_in(lines), step_times(metrics), lines, code, exit_s)
    return 0


def uploads_in(lines: list[tuple[float, str]]) -> list[tuple[float, float, float, str]]:
    """(start, end, MB, name) of each checkpoint upload the driver logged."""
    return [(t - float(m[3]), t, float(m[2]), m[1]) for t, line in list(lines)
            if (m := UPLOADED.search(line))]


def step_times(metrics: Path | None) -> dict[int, float]:
    """step -> wall time of its record (the per-step records: -p 1); an epoch's end (its
    evaluation and save) as step -1 at its time, so that no step interval spans it."""
    if metrics is None or not metrics.exists():
        return {}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = {r["step"]: r["time"] for r in records if "train/loss" in r}
    ends = [r["time"] for r in records if "train/loss" not in r]
    return {**times, **{-1 - i: t for i, t in enumerate(ends)}}


def report(server, uploads, steps: dict[int, float], lines, code: int, exit_s: float) -> None:
    import torch  # noqa: PLC0415 (only to read the bucket's last.pt back)
    during, other, saving = [], [], []
    ends = [t for step, t in steps.items() if step < 0]
    saved_after = {int(name.split("-")[1].split(".")[0]) for *_, name in uploads}
    for step in sorted(s for s in steps if s > 0):
        start, end = steps.get(step - 1), steps[step]
        if start is None or any(start < t < end for t in ends):
            continue  # the first step of a start, or one that includes an evaluation and save
        if step - 1 in saved_after:  # includes writing the checkpoint to the local disk
            saving.append(end - start)
            continue
        overlaps = any(a < end and start < b for a, b, *_ in uploads)
        (during if overlaps else other).append(end - start)
    for start, end, mb, name in uploads:
        print(f"upload: {name} {mb:.1f} MB in {end - start:.1f} s ({mb / (end - start):.0f} "
              "MB/s)")
    print(f"steps overlapping an upload: {len(during)} ({' '.join(f'{d:.2f}' for d in during)}"
          f" s), other steps: {len(other)}; steps that include a local save (as in a local "
          f"run folder, not counted above): {' '.join(f'{d:.2f}' for d in saving)} s")
    if during and other:
        busy, calm = statistics.median(during), statistics.median(other)
        print(f"step time during uploads: median {busy:.3f} s ({len(during)} steps); other "
              f"steps: median {calm:.3f} s ({len(other)} steps); ratio {busy / calm:.2f}")
    body = server.client().get_object(Bucket="bench", Key="runs/bench/checkpoints/last.pt")
    last = torch.load(io.BytesIO(body["Body"].read()), map_location="cpu", weights_only=True)
    saved = [line for _, line in lines if line.startswith("saved ")]
    print(f"SIGTERM -> exit {code} in {exit_s:.1f} s; bucket last.pt: step {last['step']}; "
          f"{saved[-1] if saved else 'no saved line'}")


if __name__ == "__main__":
    sys.exit(main())

"""How long a failed run holds on after the failure: one worker of a real driver run (as a user
starts it, nothing mocked) is SIGKILLed mid-epoch, and the clock runs from the kill to the
driver's error line and to its exit: a scheduler keeps the job (and its nodes) until then.
Each repeat is a new run."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from app.bench.start import REPO, first_train_time, started_pids, wait_for


def kill_one_worker(flags: list[str], victim: str, timeout_s: float) -> dict:
    """One run: start the driver, wait for its first logged step, SIGKILL `victim` (a worker
    named as in the driver's "started" line), time the error line and the exit."""
    with tempfile.TemporaryDirectory() as folder:
        process = subprocess.Popen([sys.executable, str(REPO / "bin" / "driver.py"), *flags,
                                    "--run-name", "killed"], cwd=folder, text=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        lines: list[tuple[float, str]] = []
        reader = threading.Thread(target=lambda: lines.extend(
            (time.monotonic(), line) for line in process.stderr), daemon=True)
        reader.start()
        said = lambda: "".join(line for _, line in lines)[-2000:]  # noqa: E731
        try:
            try:  # the workers are mid-epoch once a train step is logged
                wait_for(lambda: first_train_time(Path(folder) / "runs" / "killed" /
                                                  "metrics.jsonl"), process)
            except RuntimeError as error:
                raise RuntimeError(f"{error}: {said()}") from None
            killed = time.monotonic()
            os.kill(started_pids(line for _, line in lines)[victim], signal.SIGKILL)
            process.wait(timeout=timeout_s)
            exited = time.monotonic()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        reader.join(timeout=5)
    errors = [(when, line) for when, line in lines if line.startswith("error:") and when > killed]
    if not errors:
        raise RuntimeError(f"the driver printed no error line: {said()}")
    return {"error_line_s": errors[0][0] - killed, "exit_s": exited - killed,
            "exit_code": process.returncode, "error": errors[0][1].strip()}


def run(flags: list[str], victim: str, repeats: int, timeout_s: float = 300.0) -> dict:
    runs = [kill_one_worker(flags, victim, timeout_s) for _ in range(repeats)]
    return {"flags": flags, "victim": victim, "runs": runs,
            "median_error_line_s": statistics.median(r["error_line_s"] for r in runs),
            "median_exit_s": statistics.median(r["exit_s"] for r in runs)}


def format_report(report: dict) -> str:
    lines = [f"driver {' '.join(report['flags'])}; SIGKILL to {report['victim']} after its "
             "first logged step",
             f"{'run':<6}{'kill -> error line':>20}{'kill -> exit':>16}{'exit code':>11}"]
    for number, r in enumerate(report["runs"], 1):
        lines.append(f"{number:<6}{r['error_line_s']:>19.2f}s{r['exit_s']:>15.2f}s"
                     f"{r['exit_code']:>11}")
    lines.append(f"median: error line {report['median_error_line_s']:.2f} s, exit "
                 f"{report['median_exit_s']:.2f} s; first error: {report['runs'][0]['error']}")
    return "\n".join(lines)


"""`bin/bench.py start`: what starting a run costs: the whole machine's CPU seconds (/proc/stat:
every process counts however it was started, so the machine should be otherwise idle) and the
wall time from the command to the first optimizer step; the same after a killed worker
(`--max-restarts`), and for pytorch/examples' main.py recipe (peer_examples.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from app.bench.reports import start_row
from app.parallel.plans import free_port

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 600.0
TICKS = os.sysconf("SC_CLK_TCK")  # /proc/stat's unit


@dataclass(frozen=True)
class Setup:
    dataset: str = "sample_tiny"
    arch: str = "resnet18"
    image_size: int = 32
    batch_size: int = 16  # per worker process
    epochs: int = 1
    device: str = "cpu"  # every worker's (cuda:0: several workers share the one GPU)


@dataclass(frozen=True)
class Row:
    workers: int
    sync: str  # "local" for one worker (it runs in the driver's process), ps, allreduce
    loaders: int  # -j: loader processes per worker
    kind: str = "ours"  # ours | restart | peer

    def label(self) -> str:
        sync = "" if self.kind == "peer" or self.workers == 1 else f" {self.sync}"
        return f"{self.kind} {self.workers} worker(s){sync} -j {self.loaders}"


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot: user, nice, system, irq, softirq and
    steal of every core (idle and iowait left out)."""
    with open("/proc/stat") as handle:
        fields = [int(value) for value in handle.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / TICKS


def driver_command(setup: Setup, row: Row, out: Path) -> list[str]:
    return [sys.executable, str(REPO / "bin" / "driver.py"), "--catalog",
            str(REPO / "datasets.toml"), "--dataset", setup.dataset,
            "-a", setup.arch, "--image-size", str(setup.image_size),
            "-b", str(setup.batch_size), "--epochs", str(setup.epochs), "-p", "1",
            "-j", str(row.loaders), "--devices", ",".join([setup.device] * row.workers),
            "--sync", "auto" if row.sync == "local" else row.sync,
            "--output-dir", str(out), "--run-name", "start"]


def first_train_time(metrics: Path, after: float = 0.0) -> float | None:
    """The wall-clock time of the first train record in metrics.jsonl written after `after`."""
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            record = json.loads(line)
            if "train/loss" in record and record["time"] > after:
                return record["time"]
    return None


def timed_run(command: list[str], cwd: str | Path, row: Row,
              first_step: Callable[[str], float]) -> dict:
    """The machine's CPU s, wall s and the time to the first step (`first_step`: its
    wall-clock time, from the stdout) of a command that must succeed."""
    cpu, started = machine_cpu_seconds(), time.time()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    wall, cpu = time.time() - started, machine_cpu_seconds() - cpu
    if done.returncode:
        raise RuntimeError(f"{row.label()} failed: {done.stderr[-2000:]}")
    return {"cpu_s": cpu, "first_step_s": first_step(done.stdout) - started, "wall_s": wall}


def measure_ours(setup: Setup, row: Row) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        return timed_run(driver_command(setup, row, Path(folder)), folder, row,
                         lambda _: first_train_time(Path(folder) / "start" / "metrics.jsonl"))


def measure_restart(setup: Setup, row: Row) -> dict:
    """SIGKILL to worker 1 once the first step is logged; from the kill to the first step of
    the group started again (--max-restarts 1): wall time and the machine's CPU seconds."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "start" / "metrics.jsonl"
        process = subprocess.Popen([*driver_command(setup, row, Path(folder)),
                                    "--max-restarts", "1"], cwd=folder, text=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   start_new_session=True)
        try:
            started = wait_for(lambda: first_train_time(metrics), process)
            victim = started_pids(process.stderr)[f"worker 1 ({setup.device})"]
            cpu, killed = machine_cpu_seconds(), time.time()
            os.kill(victim, signal.SIGKILL)
            again = wait_for(lambda: first_train_time(metrics, after=killed), process)
            cpu = machine_cpu_seconds() - cpu
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return {"cpu_s": cpu, "first_step_s": again - killed, "wall_s": again - killed,
            "first_start_s": started}


def started_pids(stderr) -> dict[str, int]:
    """The driver's "started ps: worker 0 (cpu) pid 123, ..." line, read from its stderr."""
    for line in stderr:
        if "started" in line and " pid " in line:
            parts = line.split(": ", 2)[2].strip().split(", ")
            return {p.rsplit(" pid ", 1)[0]: int(p.rsplit(" pid ", 1)[1]) for p in parts}
    raise RuntimeError("the driver ended without starting its workers")


def wait_for(found: Callable[[], float | None], process: subprocess.Popen) -> float:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        value = found()
        if value is not None:
            return value
        if process.poll() is not None:
            raise RuntimeError(f"the driver ended (code {process.returncode}) too early")
        time.sleep(0.05)
    raise RuntimeError(f"nothing within {RUN_TIMEOUT_S:.0f} s")


def measure_peer(setup: Setup, row: Row, imagefolder: Path) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "app.bench.peer_examples", str(imagefolder),
                   "-a", setup.arch, "-j", str(row.loaders * row.workers),
                   "-b", str(setup.batch_size * row.workers), "--epochs", str(setup.epochs),
                   "--image-size", str(setup.image_size), "--world", str(row.workers),
                   "--dist-url", f"tcp://127.0.0.1:{free_port()}", "--out", folder]
        return timed_run(command, REPO, row, lambda stdout: next(
            json.loads(line)["first_step_time"] for line in stdout.splitlines()
            if line.startswith('{"first_step_time"')))


def rows_for(workers: list[int], syncs: list[str], loaders: list[int], restart: bool,
             peer: bool) -> list[Row]:
    rows = []
    for count in workers:
        for j in loaders:
            rows += [Row(count, mode, j) for mode in (["local"] if count == 1 else syncs)]
            if peer:
                rows.append(Row(count, "allreduce", j, "peer"))
    if restart:
        rows += [Row(2, mode, loaders[0], "restart") for mode in syncs]
    return rows


def run(setup: Setup, rows: list[Row], repeats: int, save: Callable[[dict], None]) -> dict:
    from app.catalog import Catalog, sample  # noqa: PLC0415 (no torch)
    Catalog.load(str(REPO / "datasets.toml")).open(setup.dataset)  # generated before timing
    imagefolder = sample.ensure(sample.default_cache_dir(), "tiny", 0, layout="imagefolder") \
        if any(row.kind == "peer" for row in rows) else None
    report: dict = {"setup": asdict(setup), "date": time.strftime("%Y-%m-%d"), "rows": []}
    for row in rows:
        runs = [measure_peer(setup, row, imagefolder) if row.kind == "peer" else
                (measure_restart if row.kind == "restart" else measure_ours)(setup, row)
                for _ in range(repeats)]
        medians = {f"median_{key}": statistics.median(run[key] for run in runs)
                   for key in ("cpu_s", "first_step_s", "wall_s")}
        report["rows"].append({**asdict(row), "label": row.label(), "runs": runs, **medians})
        save(report)
        print(*start_row(report["rows"][-1]), sep="  ", file=sys.stderr, flush=True)
    return report

"""`bin/bench.py upload-lag`: how long after a save the bucket's checkpoints/last.pt names the
new checkpoint (what a machine that dies without notice loses), idle and with every core busy,
per niceness of the upload process, and how much the upload slows the busy processes.
The real upload process (app/catalog/uploader.py) mirrors a staged run folder to moto_server on
loopback. The lag runs from save()'s return to the first HEAD of last.pt that shows the new
file's size: each save is longer than the one before, so a size names one save (the uploader's
own lines would not do: it says "uploaded" before last.pt is copied). The slowdown is the
load's rate before a save against its rate until last.pt arrives. moto_server does much of an
upload's CPU work here, which a real bucket does on other machines."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from app.bench.cpu_load import Load
from app.bench.loopback_s3 import MotoServer
from app.bench.usage import process_cpu_seconds
from app.catalog.remote_run import RemoteRunFolder
from app.catalog.storage import DatasetRoot
from app.catalog.uploader import UploadProcess
from app.runtime.errors import UserError
from app.training.checkpoint import CheckpointFolder

BUCKET = "upload-lag"
POLL_S = 0.2  # the HEADs of last.pt: fine enough for lags of seconds, cheap for moto_server
READY_TIMEOUT_S = 120.0  # the upload process's start and first pass, on a loaded machine
LOAD_START_TIMEOUT_S = 120.0
FINISH_TIMEOUT_S = 0.0  # the last pass has nothing left: last.pt is in the bucket by then
LAST = "checkpoints/last.pt"
GOAL_LAG_RATIO, GOAL_SLOWDOWN = 3.0, 1.25
MB = 1e6
CORES = os.cpu_count() or 1
GROWTH = 4096  # bytes each save adds to the one before: more than torch.save's padding


@dataclass(frozen=True)
class Setup:
    size_mb: float = 189.0  # ResNet-50's 25.6 M weights and SGD's momentum, float32
    nicenesses: tuple[int, ...] = (19, 10, 0)
    repeats: int = 3
    loads: int = os.cpu_count() or 1
    window_s: float = 3.0  # the load's rate without an upload, before each save
    timeout_s: float = 600.0  # per save, from the save to last.pt in the bucket


def run(setup: Setup, save: Callable[[dict], None] = lambda report: None) -> dict:
    """A row per niceness: idle saves, then loaded ones, so both meet the machine as it is
    then; the report is saved after each row."""
    report = {"setup": asdict(setup), "cores": os.cpu_count(),
              "load_average_at_start": os.getloadavg()[0],
              "load_niceness": os.getpriority(os.PRIO_PROCESS, 0), "rows": []}
    server = MotoServer()
    try:
        DatasetRoot(BUCKET, f"s3://{BUCKET}", server.storage_options()).fs.call_s3(
            "create_bucket", Bucket=BUCKET)  # s3fs.mkdir asks us-east-1 for a location: refused
        for niceness in setup.nicenesses:
            report["rows"].append(niceness_row(server, setup, niceness))
            save(report)
    finally:
        server.stop()
    return report


def niceness_row(server: MotoServer, setup: Setup, niceness: int) -> dict:
    with Mirror(server, niceness) as mirror:
        idle = [mirror.save(setup, None) for _ in range(setup.repeats)]
        load = Load(setup.loads).start()
        try:
            wait_until(load.started, LOAD_START_TIMEOUT_S, mirror.check,
                       "first units of the load")
            loaded = [mirror.save(setup, load) for _ in range(setup.repeats)]
        finally:
            load.stop()
    return summary(niceness, idle, loaded)


class Mirror:
    """A staged run folder and the upload process mirroring it to s3://upload-lag/n<niceness>,
    started before the first save, as during a run (at niceness 19 on a busy machine its start
    takes tens of seconds, which no save of a run waits for)."""

    def __init__(self, server: MotoServer, niceness: int):
        self.root = DatasetRoot(BUCKET, f"s3://{BUCKET}/n{niceness}", server.storage_options())
        self.local = Path(tempfile.mkdtemp(prefix="upload-lag-"))
        self.saves, self.last_size = 0, 0
        self.server_pid = server.process.pid
        self.reports: list[str] = []
        (self.local / "config.toml").write_text("# bin/bench.py upload-lag\n")
        try:
            self.upload = UploadProcess(self.local, RemoteRunFolder(self.root), 2,
                                        self.reports.append, niceness=niceness)
        except BaseException:
            shutil.rmtree(self.local, ignore_errors=True)
            raise
        self.checkpoints = CheckpointFolder(self.local / "checkpoints", keep=2,
                                            announce=self.upload.uploads.saved)

    def __enter__(self) -> "Mirror":
        try:  # the upload process has listed the bucket and taken a message once this is there
            wait_until(lambda: head_size(self.root, "config.toml") is not None,
                       READY_TIMEOUT_S, self.check, "first upload of the upload process")
        except BaseException as error:
            self.__exit__(type(error))
            raise
        return self

    def __exit__(self, failure: type | None, *_: object) -> None:
        self.upload.finish(FINISH_TIMEOUT_S)
        shutil.rmtree(self.local, ignore_errors=True)
        if failure is None:
            self.root.fs.rm(self.root.path(""), recursive=True)  # moto_server holds it all

    def check(self, load: Load | None = None) -> None:
        """Raises once the upload process (or a load process) has died, or an upload failed."""
        if not any(child.name == "run-folder-upload"  # as UploadProcess names it
                   for child in multiprocessing.active_children()):
            raise RuntimeError(f"the upload process ended; its reports: {self.reports}")
        failed = [line for line in self.reports if line.startswith("could not upload")]
        if failed:
            raise RuntimeError(failed[0])
        if load:
            load.check()

    def save(self, setup: Setup, load: Load | None) -> dict:
        """One checkpoint, timed from CheckpointFolder.save's return to the bucket's last.pt."""
        self.saves += 1
        payload = checkpoint_payload(int(setup.size_mb * MB) + GROWTH * self.saves,
                                     seed=self.saves)
        check = lambda: self.check(load)  # noqa: E731
        before = load_rate(load, setup.window_s, check) if load else None
        uploader = next(child.pid for child in multiprocessing.active_children()
                        if child.name == "run-folder-upload")
        cpu_before = process_cpu_seconds(uploader), process_cpu_seconds(self.server_pid)
        path = self.checkpoints.save(payload, step=self.saves)
        saved_at, units = time.monotonic(), load.units() if load else 0
        size = path.stat().st_size
        if size <= self.last_size:
            raise RuntimeError(f"{path.name} is no longer than the save before")
        self.last_size = size
        landed_at = wait_until(lambda: head_size(self.root, LAST) == size, setup.timeout_s,
                               check, "checkpoint in the bucket's last.pt (--timeout)")
        during = (load.units() - units) / (landed_at - saved_at) if load else None
        # what the upload process and the bucket each took of the machine meanwhile: a real
        # bucket's share is on other machines
        shares = [(process_cpu_seconds(pid) - before) / ((landed_at - saved_at) * CORES)
                  for pid, before in zip((uploader, self.server_pid), cpu_before)]
        saved = digest(path.open("rb"))
        bucket = digest(self.root.fs.open(self.root.path(LAST), "rb"))
        if bucket != saved:
            raise RuntimeError(f"the bucket's last.pt ({self.root.url}) is not the saved "
                               "checkpoint")
        uploaded = [float(found[1]) for line in self.reports
                    if (found := re.search(rf"uploaded checkpoints/{path.name} .* in ([\d.]+) s",
                                           line))]
        return {"lag_s": landed_at - saved_at, "bytes": size, "sha256_saved": saved,
                "sha256_last_pt": bucket,
                "upload_s": uploaded[0] if uploaded else None,  # the uploader's own figure
                "rate_before": before, "rate_during": during,
                "upload_cpu_share": shares[0], "bucket_cpu_share": shares[1]}


def checkpoint_payload(size: int, seed: int) -> dict:
    """Random bytes (nothing compresses them) in a checkpoint's form: one uint8 tensor."""
    generator = torch.Generator().manual_seed(seed)
    return {"weights": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)}


def wait_until(condition: Callable[[], bool], timeout: float, check: Callable[[], None],
               what: str) -> float:
    """Polls `condition` (and `check`, which raises once a process died) every POLL_S up to
    `timeout` s; returns the time.monotonic() at which it held."""
    deadline = time.monotonic() + timeout
    while True:
        check()
        if condition():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise UserError(f"upload-lag: no {what} within {timeout:.0f} s")
        time.sleep(POLL_S)


def load_rate(load: Load, seconds: float, check: Callable[[], None]) -> float:
    units, started = load.units(), time.monotonic()
    ended = wait_until(lambda: time.monotonic() >= started + seconds, seconds + 60, check,
                       "end of the load's window")
    return (load.units() - units) / (ended - started)


def head_size(root: DatasetRoot, relative: str) -> int | None:
    """The object's size from a HEAD request (one request: s3fs's info() may list too)."""
    bucket, key = root.path(relative).split("/", 1)
    try:
        return root.fs.call_s3("head_object", Bucket=bucket, Key=key)["ContentLength"]
    except FileNotFoundError:
        return None


def digest(handle: BinaryIO) -> str:
    with handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def summary(niceness: int, idle: list[dict], loaded: list[dict]) -> dict:
    idle_median = statistics.median(s["lag_s"] for s in idle)
    loaded_median = statistics.median(s["lag_s"] for s in loaded)
    slowdown = statistics.median(s["rate_before"] / s["rate_during"] for s in loaded)
    # the work's slowdown were the upload process the only one taking cores from it
    upload_alone = statistics.median(1 / (1 - s["upload_cpu_share"]) for s in loaded)
    ratio = loaded_median / idle_median
    return {"niceness": niceness, "idle_median_s": idle_median,
            "idle_max_s": max(s["lag_s"] for s in idle), "loaded_median_s": loaded_median,
            "loaded_max_s": max(s["lag_s"] for s in loaded), "loaded_over_idle": ratio,
            "work_slowdown": slowdown, "slowdown_by_the_upload_alone": upload_alone,
            "meets_goal": ratio <= GOAL_LAG_RATIO and upload_alone <= GOAL_SLOWDOWN,
            "idle": idle, "loaded": loaded}


def format_report(report: dict) -> str:
    setup = report["setup"]
    lines = [f"{setup['size_mb']:.0f} MB checkpoint -> moto_server on loopback; "
             f"{report['cores']} cores, load average {report['load_average_at_start']:.1f} "
             f"at the start (idle rows: nothing of the bench's beside the upload); "
             f"{setup['loads']} load processes at niceness {report.get('load_niceness')}; "
             f"{setup['repeats']} saves each",
             f"{'niceness':>8}{'idle median':>13}{'loaded median':>15}{'loaded max':>12}"
             f"{'loaded/idle':>13}{'work slowdown':>15}{'by upload':>11}{'goal':>6}"]
    for row in report["rows"]:
        lines.append(f"{row['niceness']:>8}{row['idle_median_s']:>12.2f}s"
                     f"{row['loaded_median_s']:>14.2f}s{row['loaded_max_s']:>11.2f}s"
                     f"{row['loaded_over_idle']:>12.2f}x{row['work_slowdown']:>14.2f}x"
                     f"{row.get('slowdown_by_the_upload_alone', 0):>10.2f}x"
                     f"{'met' if row['meets_goal'] else 'no':>6}")
    lines.append(f"lag: save() -> the bucket's last.pt holds it; goal: loaded median within "
                 f"{GOAL_LAG_RATIO:g}x the idle one, the load slowed at most {GOAL_SLOWDOWN:g}x "
                 "by the upload process's own CPU (moto_server's is a real bucket's elsewhere)")
    return "\n".join(lines)

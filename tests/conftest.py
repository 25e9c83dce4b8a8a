"""Shared fixtures: the tiny sample dataset (generated once per session into a temporary
cache), mutable copies of it, catalogs pointing at them, and the driver (its main() here, its
workers real processes; or a real driver process)."""

from __future__ import annotations

import contextlib
import csv
import functools
import inspect
import logging
import os
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

# One thread per process: the suite runs two tests at once (xdist), each starting workers, on a
# 2-core machine, where more threads only spin against each other (OpenMP's busy waits cost a
# quarter of the suite's CPU time). Set before torch is imported; the workers inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import fsspec  # noqa: E402
import pytest  # noqa: E402
import tomli_w  # noqa: E402
import torch  # noqa: E402

from app.catalog import sample
from app.launch.run import main as run_main
from app.runtime.cli import run_cli
from app.runtime.liveness import is_alive

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif "gpu2" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
    if os.environ.get("IMAGENET_DP_TESTS_FASTEST_FIRST"):  # gpu-check's gpu tests part
        items.sort(key=processes_started)  # stable: the files' order among equals


# What starts a driver or bench process: tens of seconds each on a GPU machine (imports, CUDA,
# workers), where a test that stays in its own process takes seconds.
PROCESS_STARTS = ("run_driver(", "stop_with_sigterm_after(", "kill_worker_after(",
                  "start_until_step(", "bench(")


def processes_started(item) -> int:
    """An estimate of a test's cost from its source: the processes it starts."""
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        return 0
    return sum(source.count(call) for call in PROCESS_STARTS)


@pytest.fixture(scope="session", autouse=True)
def sample_cache(tmp_path_factory) -> Path:
    """Every test (and every subprocess it starts) generates samples into a temporary cache."""
    cache = tmp_path_factory.mktemp("sample-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("IMAGENET_DP_CACHE", str(cache))
        patch.setenv("WANDB_MODE", "offline")
        yield cache


@pytest.fixture(scope="session")
def tiny_sample(sample_cache) -> Path:
    return sample.ensure(sample_cache, "tiny", 0)


@pytest.fixture(scope="session")
def tiny_imagefolder(sample_cache) -> Path:
    """The tiny sample's images in the ImageFolder layout (train/<wnid>/, val/<wnid>/)."""
    return sample.ensure(sample_cache, "tiny", 0, layout="imagefolder")


@pytest.fixture
def tiny_copy(tiny_sample, tmp_path) -> Path:
    """A private copy of the tiny sample that a test may damage."""
    return Path(shutil.copytree(tiny_sample, tmp_path / "imagenet"))


def write_catalog(path: Path, datasets: dict, default: str | None = None) -> Path:
    data = {"default": default or next(iter(datasets)), "datasets": datasets}
    path.write_text(tomli_w.dumps(data))
    return path


@pytest.fixture
def catalog_for(tmp_path):
    """catalog_for(folder) -> path of a datasets.toml whose entry `data` points at folder."""
    def make(folder: Path, **options) -> Path:
        return write_catalog(tmp_path / "datasets.toml", {"data": {"url": str(folder), **options}})
    return make


def run_driver(*args: str, cwd: Path, timeout: float = 240, env: dict | None = None,
               open_files: int | None = None, separate: bool = False
               ) -> subprocess.CompletedProcess:
    """The driver as a user runs it, its workers and server real processes. Its main() runs in
    this test process (`run_here`), whose forkserver (app/runtime/forkserver.py) imported
    torch and the model library once for all the session's runs (seconds of imports each run
    would pay in a process of its own); `separate=True`, or `open_files` (the soft limit of
    open file descriptors, `ulimit -n`, inherited by its children), runs bin/driver.py in a
    real Python process. A run here is bounded by the test's own timeout (pyproject's), not
    `timeout`."""
    if separate or open_files:
        return driver_process(args, cwd, timeout, env, open_files)
    return run_here(run_main, args, cwd, env, "bin/driver.py")


def run_tool(script: str, *args, cwd: Path, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    """bin/<script> (export.py, predict.py, validate.py, plot.py, bench.py) as `run_here`
    runs the driver: its main() in this test process, which imported torch and the model
    library once."""
    return run_here(tool_main(script), [str(arg) for arg in args], cwd, env, f"bin/{script}")


@functools.cache
def tool_main(script: str) -> Callable[[list[str]], int]:
    return runpy.run_path(str(REPO / "bin" / script))["main"]  # not run as __main__


def run_here(main: Callable[[list[str]], int], args, cwd: Path, env: dict | None,
             program: str) -> subprocess.CompletedProcess:
    """An entry point's main(args) in this process, in what a process of its own would have
    (`entry_point_surroundings`): its exit code, stdout and stderr, as subprocess.run gives them."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        with entry_point_surroundings(cwd, env, [program, *args], out, err):
            try:
                code = run_cli(main, list(args))
            except SystemExit as exit:  # argparse's usage errors and --help
                code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([program, *args], code, out.read(), err.read())


def driver_process(args, cwd, timeout, env, open_files) -> subprocess.CompletedProcess:
    def limit_open_files() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, hard))
    return subprocess.run([sys.executable, str(REPO / "bin" / "driver.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})},
                          preexec_fn=limit_open_files if open_files else None)


@contextlib.contextmanager
def entry_point_surroundings(cwd: Path, env: dict | None, argv: list[str], out, err):
    """What a process of its own would have: its working folder, environment, argv,
    stdout and stderr (the descriptors, which its children take over, and Python's streams),
    and the log lines the driver's run_cli shows at INFO on stderr (pytest's own handlers
    already on the root logger would make its logging.basicConfig do nothing)."""
    saved_cwd, saved_environ, saved_argv = os.getcwd(), dict(os.environ), sys.argv
    saved_streams = sys.stdout, sys.stderr
    root, handler = logging.getLogger(), None
    saved_level = root.level
    for stream in saved_streams:
        stream.flush()
    saved_fds = os.dup(1), os.dup(2)
    try:
        forget_filesystems()
        os.chdir(cwd)
        os.environ.update(env or {})
        sys.argv = [str(REPO / argv[0]), *map(str, argv[1:])]
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (closed below)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if stream not in saved_streams:
                stream.close()  # flushes; the descriptors stay
        root.removeHandler(handler)
        root.setLevel(saved_level)
        sys.stdout, sys.stderr = saved_streams
        for fd, saved in zip((1, 2), saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_environ)
        os.chdir(saved_cwd)
        forget_filesystems()


def forget_filesystems() -> None:
    """fsspec keeps one filesystem per set of options, and its listings, for the life of a
    process, where a driver of its own starts without any: a bucket written by other processes
    meanwhile (a run stopped on another machine), other credentials in the environment."""
    classes = [fsspec.AbstractFileSystem]
    while classes:
        cls = classes.pop()
        cls.clear_instance_cache()
        classes.extend(cls.__subclasses__())


def worker_pids(stderr_text: str) -> dict[str, int]:
    """{"worker 1 (cpu)": pid, ...} from the driver's "started ..." line."""
    line = next(l for l in stderr_text.splitlines() if "started" in l)
    parts = line.split("started ", 1)[1].split(": ", 1)[1].split(", ")
    return {part.rsplit(" pid ", 1)[0]: int(part.rsplit(" pid ", 1)[1]) for part in parts}


def read_line_with(process, *texts: str) -> str:
    """The driver's stderr up to the first line containing one of `texts` (or its end)."""
    lines = []
    while True:
        line = process.stderr.readline()
        lines.append(line)
        if any(text in line for text in texts) or not line:
            return "".join(lines)


def read_started_line(process) -> str:
    return read_line_with(process, "started")


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker.encode() in handle.read() and is_alive(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def start_driver(tmp_path, *args, env: dict | None = None):
    """A driver in the background, marked so that every process it starts can be found."""
    marker = f"IMAGENET_DP_TEST={uuid.uuid4()}"
    env = {**os.environ, **(env or {}), marker.split("=")[0]: marker.split("=")[1]}
    process = subprocess.Popen(
        [sys.executable, str(REPO / "bin" / "driver.py"), "--catalog", str(REPO / "datasets.toml"),
         "--dataset", "sample_tiny", *TINY_TRAIN_FLAGS, "-b", "4", "--epochs", "50", "-p", "1",
         "--devices", "cpu,cpu", "--run-name", "long", *args],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return process, marker


def wait_for_training(tmp_path, process, steps: int = 3, timeout: float = 120) -> None:
    metrics = tmp_path / "runs" / "long" / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError("training did not start in time")


def held_pid(process, folder: Path, moment: str, timeout: float = 120) -> int:
    """The pid of the process of `process`'s run that stopped at `moment`
    (app/runtime/moments.py: IMAGENET_DP_PAUSE_AT), once it is stopped; fails if the driver
    ends first or none gets there within `timeout` seconds."""
    return held_pids(process, folder, moment, 1, timeout)[0]


def held_pids(process, folder: Path, moment: str, count: int, timeout: float = 120
              ) -> list[int]:
    """The pids of `count` processes held at `moment` (`moment*` in IMAGENET_DP_PAUSE_AT holds
    every process that gets there), each stopped, or, for a thread, waiting to be released."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p.suffix[1:]) for p in folder.glob(f"{moment}.*") if p.suffix[1:].isdigit()]
        held = [pid for pid in pids if held_in_thread(folder, moment, pid) or is_stopped(pid)]
        if len(held) >= count:
            return sorted(held)
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"not {count} processes reached {moment}")


def held_in_thread(folder: Path, moment: str, pid: int) -> bool:
    """Whether a thread of `pid` holds at `moment`, not the whole process (its file says so)."""
    return (folder / f"{moment}.{pid}").read_text() == "thread"


def release(folder: Path, moment: str, pid: int) -> None:
    """Lets the process (or the thread of it) held at `moment` go on; one ended meanwhile (the
    driver ended it) is left."""
    (folder / f"{moment}.{pid}.go").touch()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP): the state after the command in /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] == "T"


def skipped_rows(run_dir: Path) -> list[dict]:
    """runs/<run>/skipped.tsv as rows keyed by its header (epoch, split, path, reason)."""
    with open(run_dir / "skipped.tsv", newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t"))


# Small and fast: a timm ResNet with 16-192 channels, at 32 px.
TINY_TRAIN_FLAGS = ("-a", "test_resnet", "--image-size", "32", "-b", "32", "-j", "0",
                    "--lr", "0.4", "--warmup-epochs", "0.5", "--wd", "5e-5")


@pytest.fixture(scope="session")
def straight(tmp_path_factory, worker_id):
    """straight(split): the last checkpoint of tests/exact_runs.py's run in that split, never
    stopped: what every interrupted run of it must end with. Each split runs once per suite,
    whichever test process asks first (pytest-xdist's processes share the folder above their
    own temporary folders)."""
    from exact_runs import uninterrupted_end
    shared = tmp_path_factory.getbasetemp()
    cache = (shared if worker_id == "master" else shared.parent) / "uninterrupted-runs"
    cache.mkdir(exist_ok=True)
    return functools.partial(uninterrupted_end, cache)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto_server on loopback; credentials come from the standard AWS chain (environment)."""
    from s3 import ACCESS_KEY, SECRET_KEY, MotoServer
    empty = tmp_path_factory.mktemp("aws") / "none"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        patch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        patch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask for an instance role
        patch.setenv("AWS_CONFIG_FILE", str(empty))  # the developer's ~/.aws stays out
        patch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
        server = MotoServer()
        yield server
        server.stop()


@pytest.fixture(scope="session")
def s3_tiny(s3_server, tiny_sample) -> str:
    """The tiny sample in a bucket: s3://imagenet-test/ilsvrc."""
    return s3_server.upload(tiny_sample, "imagenet-test", "ilsvrc")

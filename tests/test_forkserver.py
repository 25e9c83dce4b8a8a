"""The forkserver the run's processes start from (app/runtime/forkserver.py), and the traps of
Python's forkserver, each shown here: a child sees the caller's environment, sys.path and
output as they are when it starts, not as they were when the server started; a preload that cannot be
imported fails loudly, with its reason; the server dies with the process that started it, even
while it imports; its preload never initialises CUDA; a process that has made an object-store
request forks no loader processes.

What the processes of a real run import: tests/test_imports.py; kills at each moment:
tests/test_process_deaths.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.config import Config
from app.launch.run import worker_imports
from app.parallel.launcher import child_entry
from app.runtime import forkserver
from app.runtime.errors import UserError
from app.runtime.forkserver import ByName
from app.runtime.liveness import is_alive

LIGHT = ["json"]  # a preload that costs nothing: these tests are about the server itself


def report_environment(path: str) -> None:
    """In a child: what it sees of the caller's environment and sys.path."""
    Path(path).write_text(json.dumps({"mark": os.environ.get("IMAGENET_DP_TEST_MARK"),
                                      "path": sys.path, "parent": os.getppid()}))
    print(f"printed with the mark {os.environ.get('IMAGENET_DP_TEST_MARK')}", flush=True)


@contextlib.contextmanager
def stdout_to(path: Path):
    """This process's stdout (the descriptor, as a caller's capture or redirection sets it)
    goes to `path` meanwhile."""
    sys.stdout.flush()
    saved, target = os.dup(1), os.open(path, os.O_WRONLY | os.O_CREAT)
    os.dup2(target, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(target)


def start_child(path: Path) -> dict:
    """A child started as the launcher starts workers (child_entry), reporting to `path`."""
    context = forkserver.context(LIGHT)
    reports = context.Queue()  # kept: its semaphores go when it does, maybe before the child
    child = context.Process(target=child_entry, args=(
        "child", ByName(__name__, "report_environment"), (str(path),), reports,
        forkserver.caller_now(), forkserver.server_pid()))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    return json.loads(path.read_text())


def test_a_child_sees_the_callers_environment_sys_path_and_output_as_they_are_when_it_starts(
        tmp_path, monkeypatch):
    """As a second app.train in one notebook, after the notebook changed all three: the server
    started before the changes serves both calls."""
    monkeypatch.setenv("IMAGENET_DP_TEST_MARK", "before")
    with stdout_to(tmp_path / "first.out"):
        first = start_child(tmp_path / "first.json")
    server = forkserver.server_pid()
    monkeypatch.setenv("IMAGENET_DP_TEST_MARK", "after")
    monkeypatch.syspath_prepend(str(tmp_path / "added"))
    with stdout_to(tmp_path / "second.out"):
        second = start_child(tmp_path / "second.json")
    assert (tmp_path / "first.out").read_text() == "printed with the mark before\n"
    assert (tmp_path / "second.out").read_text() == "printed with the mark after\n"
    assert forkserver.server_pid() == server == first["parent"] == second["parent"]
    assert (first["mark"], second["mark"]) == ("before", "after")
    assert str(tmp_path / "added") in second["path"]
    assert str(tmp_path / "added") not in first["path"]


def test_a_preload_that_cannot_be_imported_fails_loudly_with_its_reason(tmp_path,
                                                                         monkeypatch):
    """Python's forkserver skips a module it cannot import without a word; every process
    would then pay its imports itself."""
    (tmp_path / "preload_needs_libfoo.py").write_text(
        "raise ImportError('libfoo.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"could not import preload_needs_libfoo: ImportError: "
                                        r"libfoo\.so\.1: cannot open shared object file"):
        forkserver.context(["preload_needs_libfoo"])
    with pytest.raises(UserError, match=r"could not import no_such_module_here: "
                                        r"ModuleNotFoundError"):
        forkserver.context(["no_such_module_here"])
    assert forkserver.context(LIGHT)  # the next start is not held back by the failed module


def test_the_preload_reaches_modules_on_the_callers_sys_path_only(tmp_path, monkeypatch):
    """A module importable only through sys.path as the caller changed it (a notebook's
    sys.path.append): Python's server would not see it; ours imports it before any child."""
    (tmp_path / "preload_marker_module.py").write_text("import os\nLOADED_IN = os.getpid()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forkserver.context(["preload_marker_module"])  # else: "not importable when the server
    # started (sys.path?)", from the probe, which finds it on the sys.path it is given


def test_a_server_killed_while_it_imports_is_a_failure_not_a_silent_new_server(
        tmp_path, monkeypatch):
    (tmp_path / "preload_takes_a_while.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forkserver.start(["preload_takes_a_while"])
    server = forkserver.server_pid()
    time.sleep(0.5)
    os.kill(server, signal.SIGKILL)
    with pytest.raises(forkserver.StartFailure, match=rf"forkserver \(pid {server}\) .* died "
                                                       "while it imported"):
        forkserver.context(["preload_takes_a_while"])
    assert not forkserver.is_running()


def test_the_server_dies_with_the_process_that_started_it_even_while_importing(tmp_path):
    """Its children die with it in turn (their parent-death signal), so nothing outlives a
    killed driver; Python's server would go on importing, then serve any child still alive."""
    (tmp_path / "preload_takes_a_while.py").write_text("import time\ntime.sleep(60)\n")
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from app.runtime import forkserver; "
              "forkserver.start(['preload_takes_a_while']); print(forkserver.server_pid(), "
              "flush=True); import time; time.sleep(60)")
    starter = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], text=True,
                               stdout=subprocess.PIPE, cwd=Path(__file__).parents[1],
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    server = int(starter.stdout.readline())
    time.sleep(0.5)
    assert is_alive(server)
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 3
    while is_alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(server)


def test_the_preload_of_a_run_never_initialises_cuda():
    """Children that use a GPU are forked from the server: CUDA must not be initialised there
    (a forked child could not use it). Every call that would initialise it is recorded while
    the preload of a run is imported."""
    modules = worker_imports(Config())
    script = ("import torch.cuda, importlib, sys; calls = []; "
              "torch.cuda._lazy_init = lambda *a, **k: calls.append('_lazy_init'); "
              "torch.cuda.init = lambda: calls.append('init'); "
              f"[importlib.import_module(m) for m in {modules!r}]; "
              "print(calls, torch.cuda.is_initialized())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "False"]
    assert "app.models.timm_lib" in modules and "app.launch.worker" in modules


@pytest.mark.gpu
def test_a_child_of_the_server_can_initialise_cuda(tmp_path):
    context = forkserver.context(worker_imports(Config()))
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=cuda_in_child, args=(writer,))
    child.start()
    writer.close()
    assert reader.recv() == (False, True)  # not initialised before; usable after
    child.join(timeout=60)


def cuda_in_child(writer) -> None:
    import torch  # noqa: PLC0415
    before = torch.cuda.is_initialized()
    torch.zeros(1, device="cuda").add_(1)
    writer.send((before, torch.cuda.is_initialized()))


def test_a_loader_forks_unless_this_process_runs_an_object_stores_threads(s3_server):
    """obstore's requests run on a tokio runtime; a child forked after one hangs on its own
    first request (even through a new client). fsspec and s3fs start afresh in a child, and
    a client that has made no request has no threads yet. Loaders that read without obstore
    (a local copy, the s3fs reader) fork all the same."""
    client = s3_server.client()
    client.create_bucket(Bucket="forks")
    client.put_object(Bucket="forks", Key="hello.txt", Body=b"hello")
    script = f"""
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
from app.catalog.storage import DatasetRoot
from app.data.loader_processes import start_method
root = DatasetRoot("x", "s3://forks", {{"endpoint_url": "{s3_server.endpoint}"}},
                   store_options={{"endpoint_url": "{s3_server.endpoint}", "region": "us-east-1"}})
assert root.read_bytes("hello.txt") == b"hello"  # through s3fs
root.store  # an obstore client, no request yet
print(start_method())
import obstore
assert obstore.get(root.store, "hello.txt").bytes() == b"hello"
print(start_method())
print(start_method(uses_obstore=False))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fork", "spawn", "fork"]
    assert "loader processes are spawned, not forked: this process runs tokio" in done.stderr

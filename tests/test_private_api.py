"""A canary for app/runtime/private_api.py: each private name of Python and torch it uses
exists, with the shape it uses (attributes, parameters, what the name does), so that a release
that moves one fails here, naming it, rather than in a run."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]


def private(dotted: str):
    """The object at `dotted` (module, then attributes), or a failure that names it."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
            break
        except ImportError:
            continue
    for name in parts[split:]:
        if not hasattr(found, name):
            pytest.fail(f"{dotted} is gone in this release; app/runtime/private_api.py uses it")
        found = getattr(found, name)
    return found


def run_python(script: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


OWNERS = ("torch", "multiprocessing")


def is_private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def private_names_used(source: str) -> list[str]:
    """'line: name' for each private name of torch or multiprocessing (and their submodules)
    that `source`'s code imports or reads; strings and comments do not count."""
    tree = ast.parse(source)
    imports_from_owner = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                          and (node.module or "").split(".")[0] in OWNERS]
    from_owner = {alias.asname or alias.name for node in imports_from_owner
                  for alias in node.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: {alias.name}" for alias in node.names
                      if alias.name.split(".")[0] in OWNERS and is_private(alias.name)]
        elif node in imports_from_owner:
            found += [f"{node.lineno}: {name}" for name in
                      (node.module, *(alias.name for alias in node.names)) if is_private(name)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in (*OWNERS, *from_owner):
                found.append(f"{node.lineno}: {node.attr}")
    return sorted(set(found), key=lambda line: int(line.split(":")[0]))


def test_no_private_name_of_python_or_torch_outside_private_api():
    used = [f"{path.relative_to(REPO)}:{found}"
            for path in sorted((REPO / "app").rglob("*.py")) if path.name != "private_api.py"
            for found in private_names_used(path.read_text())]
    assert used == [], "private names belong in app/runtime/private_api.py"


def test_the_private_name_finder_finds_uses_and_imports_not_strings():
    planted = ("import torch\nfrom multiprocessing import forkserver\n"
               "from torch.utils.data.dataloader import (\n    _MultiProcessingDataLoaderIter)\n"
               "x = torch._dynamo.config\ny = 'torch._dynamo' in modules  # torch._foreach_mul_\n"
               "z = forkserver._forkserver\nfrom torch._dynamo.utils import counters\n")
    assert [line.split(":")[0] for line in private_names_used(planted)] == ["3", "5", "7", "8"]


def test_the_forkserver_keeps_the_pid_of_the_server_it_started():
    server = private("multiprocessing.forkserver._forkserver")
    assert "_forkserver_pid" in vars(server), \
        "multiprocessing.forkserver._forkserver._forkserver_pid is gone in this release"
    # And a server found dead (not reaped: app/runtime/forkserver.py leaves it) is reaped and
    # replaced by ensure_running, which the pid then names.
    first, second, replaced = run_python(
        "import os, signal; from multiprocessing import forkserver; "
        "from app.runtime.private_api import forkserver_pid; "
        "forkserver.set_forkserver_preload([]); forkserver.ensure_running(); "
        "first = forkserver_pid(); os.kill(first, signal.SIGKILL); "
        "os.waitid(os.P_PID, first, os.WEXITED | os.WNOWAIT); forkserver.ensure_running(); "
        "second = forkserver_pid(); "
        "print(first, second, os.waitid(os.P_PID, second, os.WEXITED | os.WNOHANG | os.WNOWAIT) "
        "is None and os.getpid() == int(open(f'/proc/{second}/stat').read().rsplit(')')[1]"
        ".split()[1]))")
    assert first != second and replaced == "True", \
        "multiprocessing.forkserver._forkserver._forkserver_pid no longer names the server"


def test_starting_a_process_calls_the_forkservers_ensure_running_which_can_be_refused():
    server = private("multiprocessing.forkserver._forkserver")
    assert private("multiprocessing.forkserver.connect_to_new_process").__self__ is server, \
        "multiprocessing.forkserver.connect_to_new_process is no method of _forkserver any more"
    assert run_python(
        "from multiprocessing import get_context, forkserver; "
        "from app.runtime.private_api import forkserver_restart_refused\n"
        "def refuse(): raise LookupError\n"
        "with forkserver_restart_refused(refuse):\n"
        "    try: get_context('forkserver').Process(target=len, args=((),)).start(); "
        "print('started')\n"
        "    except LookupError: print('refused')\n"
        "print('ensure_running' in vars(forkserver._forkserver))") == ["refused", "False"], \
        "multiprocessing.forkserver._forkserver.ensure_running is no longer what a start calls"


def test_a_descriptor_reaches_a_child_of_the_forkserver_through_dupfd():
    dup_fd = private("multiprocessing.reduction.DupFd")
    assert list(inspect.signature(dup_fd).parameters) == ["fd"], \
        "multiprocessing.reduction.DupFd no longer takes one descriptor"
    assert run_python(
        "import os; from multiprocessing import get_context\n"
        "from app.runtime.private_api import PassedFd\n"
        "reader, writer = os.pipe()\n"
        "process = get_context('forkserver').Process(target=os.write,\n"
        "                                            args=(PassedFd(writer), b'passed'))\n"
        "process.start(); process.join(60); os.close(writer)\n"
        "print(process.exitcode, os.read(reader, 64).decode())") == ["0", "passed"], \
        "multiprocessing.reduction.DupFd no longer hands a child of the forkserver our descriptor"


def test_torchs_foreach_operations_copy_interpolate_and_scale_lists_of_tensors():
    import torch  # noqa: PLC0415

    from app.runtime.private_api import foreach  # noqa: PLC0415
    for operation in ("copy_", "lerp_", "mul_"):
        private(f"torch._foreach_{operation}")
    targets = [torch.zeros(3), torch.full((2, 2), 4.0)]
    sources = [torch.arange(3.0), torch.ones(2, 2)]
    foreach("lerp_")(targets, sources, 0.25)
    assert torch.equal(targets[0], torch.tensor([0.0, 0.25, 0.5]))
    assert torch.equal(targets[1], torch.full((2, 2), 3.25))
    foreach("mul_")(targets, 4.0)
    assert torch.equal(targets[1], torch.full((2, 2), 13.0))
    foreach("copy_")(targets, sources)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))


def test_atexit_runs_its_handlers_on_request():
    assert callable(private("atexit._run_exitfuncs"))  # a builtin: no signature to read
    assert run_python("import atexit, os; from app.runtime.private_api import run_exit_handlers; "
                      "atexit.register(print, 'ran'); run_exit_handlers(); os._exit(0)") == \
        ["ran"], "atexit._run_exitfuncs() no longer runs the handlers"


def test_the_dataloader_keeps_its_processes_on_its_iterator_and_waits_in_steps():
    iterator = private("torch.utils.data.dataloader._MultiProcessingDataLoaderIter")
    interval = private("torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL")
    timeout = inspect.signature(private(
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._try_get_data")
    ).parameters.get("timeout")
    assert timeout is not None and timeout.default == interval, \
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._try_get_data(timeout=" \
        "MP_STATUS_CHECK_INTERVAL) changed"
    assert list(inspect.signature(private(
        "torch.utils.data.DataLoader._get_iterator")).parameters) == ["self"], \
        "torch.utils.data.DataLoader._get_iterator(self) changed"
    assert isinstance(iterator, type)
    # In a thread of a process without torch's SIGCHLD handler (set from the main thread only),
    # a killed loader process is noticed by the wait's own check alone: within its step.
    found = run_python("""
import os, signal, threading, time
from torch.utils.data import Dataset
from app.runtime.private_api import loader_polling_every, loader_processes

class Stuck(Dataset):
    def __len__(self): return 4
    def __getitem__(self, index): time.sleep(60)

loader = loader_polling_every(0.2)(Stuck(), num_workers=1, multiprocessing_context="fork",
                                   persistent_workers=True)
print(loader_processes(loader) == [])
failed = []
def wait():
    try:
        next(iter(loader))
    except RuntimeError as error:
        failed.append(time.monotonic())
threading.Thread(target=wait, daemon=True).start()
deadline = time.monotonic() + 30
while not loader_processes(loader) and time.monotonic() < deadline:
    time.sleep(0.01)
(process,) = loader_processes(loader)
killed = time.monotonic()
os.kill(process.pid, signal.SIGKILL)
deadline = killed + 10
while not failed and time.monotonic() < deadline:
    time.sleep(0.01)
print(type(loader._iterator).__name__, round(failed[0] - killed, 1) if failed else None)
os._exit(0)
""")
    assert found[:2] == ["True", "PollingIterator"], \
        "torch.utils.data.DataLoader._iterator / ._get_iterator changed"
    assert found[2] != "None" and float(found[2]) < 2, \
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._try_get_data's timeout " \
        f"no longer sets how often a wait checks its processes (noticed after {found[2]} s)"


def test_torchs_error_for_a_dead_loader_names_its_pid_and_how_it_ended():
    """torch's SIGCHLD handler words, read by loader_death_told: a loader killed by SIGKILL,
    and one that exited with code 3."""
    told = run_python("""
import os, signal, time
from torch.utils.data import DataLoader, Dataset
from app.runtime.private_api import loader_death_told, loader_processes, names_a_loader

class Ends(Dataset):
    def __init__(self, code): self.code = code
    def __len__(self): return 4
    def __getitem__(self, index):
        if self.code is not None:
            os._exit(self.code)
        time.sleep(60)

for code in (None, 3):
    loader = DataLoader(Ends(code), num_workers=1, multiprocessing_context="fork",
                        persistent_workers=True)
    batches = iter(loader)
    (process,) = loader_processes(loader)
    if code is None:
        os.kill(process.pid, signal.SIGKILL)
    try:
        next(batches)
    except RuntimeError as error:
        pid, ended = loader_death_told(error)
        print(pid == process.pid, ended, names_a_loader(error))
""")
    assert told == ["True", str(-9), "True", "True", "3", "True"], \
        "torch's words for a dead DataLoader worker changed (private_api.loader_death_told)"

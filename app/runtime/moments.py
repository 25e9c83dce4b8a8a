"""Named moments in a process's life, where a test can hold the process to kill it exactly
there, or read what it has imported by then; without these variables a moment costs one lookup:

- IMAGENET_DP_PAUSE_AT=NAME[,NAME...] and IMAGENET_DP_PAUSE_DIR=FOLDER: the first process of a
  run to reach NAME (every process, for NAME*) writes FOLDER/NAME.PID and stops itself
  (SIGSTOP); the test then kills it, or lets it go on (SIGCONT). A thread other than the main
  one holds alone (the file says "thread"), so that its driver's thread still takes signals,
  until FOLDER/NAME.PID.go appears.
- IMAGENET_DP_IMPORTS_DIR=FOLDER: at each moment the process writes the packages outside the
  standard library it has imported to FOLDER/NAME.PID.imports (tests/test_imports.py).

The moments (grep `moment(`): driver:importing, driver:launch, driver:started,
driver:restart-wait, driver:end, server:start, server:registered, worker:start,
worker:building-model, worker:resuming, worker:starting-loaders, worker:first-batch,
worker:step-N (after optimizer step N), worker:evaluating, worker:end, loader:start,
loader:batch, checkpoint:saving, checkpoint:saved, upload:FILE-NAME (the upload process,
before it puts that file). Imports nothing of app/.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PAUSE_AT = "IMAGENET_DP_PAUSE_AT"
PAUSE_DIR = "IMAGENET_DP_PAUSE_DIR"
IMPORTS_DIR = "IMAGENET_DP_IMPORTS_DIR"


def moment(name: str) -> None:
    """This process has reached `name`."""
    if IMPORTS_DIR in os.environ:
        record_imports(name, os.environ[IMPORTS_DIR])
    names = os.environ.get(PAUSE_AT, "").split(",")
    if name in names or f"{name}*" in names:
        pause(name, os.environ[PAUSE_DIR], every=f"{name}*" in names)


def pause(name: str, folder: str, every: bool) -> None:
    try:  # the first process to get here pauses; the rest go on (every one: all pause)
        os.close(os.open(os.path.join(folder, f"{name}.claimed"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        if not every:
            return
    held = os.path.join(folder, f"{name}.{os.getpid()}")
    in_thread = threading.current_thread() is not threading.main_thread()
    with open(held, "w") as handle:
        handle.write("thread" if in_thread else "")
    if not in_thread:
        os.kill(os.getpid(), signal.SIGSTOP)
    deadline = time.monotonic() + 600  # a test that never releases it fails, then this goes on
    while in_thread and not os.path.exists(f"{held}.go") and time.monotonic() < deadline:
        time.sleep(0.01)


def record_imports(name: str, folder: str) -> None:
    """The packages outside the standard library, and torch._dynamo (seconds of its own)."""
    packages = sorted({module.split(".")[0] for module in list(sys.modules)
                       if not module.startswith("_")} - sys.stdlib_module_names)
    packages += ["torch._dynamo"] if "torch._dynamo" in sys.modules else []
    path = os.path.join(folder, f"{name}.{os.getpid()}.imports")
    with open(path + ".part", "w") as handle:
        handle.write("\n".join(packages) + "\n")
    os.replace(path + ".part", path)

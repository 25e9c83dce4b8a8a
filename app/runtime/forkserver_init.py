"""The first module the forkserver imports (app/runtime/forkserver.py puts it first in the
preload): from then on the server dies with the process that started it, even in the seconds
it spends importing the rest, and its children die with it (they ask the same for themselves).
Without this, a driver killed while the server imports would leave the server importing on
for seconds, and one killed later would leave it running as long as a child holds its pipe.

It also ignores the stop signals in the server: a stop signal sent to every process of a run
(Slurm, systemd, `kill -- -PGID`) is a request to save that the driver acts on, and the server
(which does not keep the mask it was started with) must outlive it; it ends with the driver.

Its work is what importing it does: a module with a side effect on purpose, since a module name
is all that Python's forkserver takes. Imports nothing of app/ but runtime.liveness and
runtime.interrupts.
"""

from __future__ import annotations

import os

from app.runtime.interrupts import ignore_stop_signals
from app.runtime.liveness import die_with_parent

PARENT = "IMAGENET_DP_FORKSERVER_PARENT"  # the starting process's pid, set for the server only

if PARENT in os.environ:
    die_with_parent()
    ignore_stop_signals()
    if os.getppid() != int(os.environ.pop(PARENT)):  # gone before the line above
        os._exit(0)

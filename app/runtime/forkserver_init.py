"""The forkserver's first import (forkserver.py puts it first in the preload): from then on the
server dies with the process that started it, even while it imports the rest, and its children
die with it; else a killed driver would leave it importing on, or running while a child holds
its pipe. It also ignores the stop signals: sent to every process of a run (Slurm,
`kill -- -PGID`), they are a request to save that the driver acts on, and the server (which
does not keep the mask it was started with) must outlive it. A side effect on import, on
purpose: a module name is all Python's forkserver takes."""

from __future__ import annotations

import os

from app.runtime.stop_signals import ignore_in_child
from app.runtime.liveness import die_with_parent

PARENT = "IMAGENET_DP_FORKSERVER_PARENT"  # the starting process's pid, set for the server only

if PARENT in os.environ:
    die_with_parent(int(os.environ.pop(PARENT)))
    ignore_in_child()

"""Whether this process may fork a child that goes on running Python: loader processes are forked
from their worker (they get its imports and the dataset's table for free), unless something
here would not survive the fork. obstore's client runs its requests on a tokio runtime whose
threads a fork does not copy: a child forked after this process used obstore hangs on its first
request, even through a new client (obstore 0.12.1). fsspec and s3fs restart their event loop
in a forked child, and loader processes never use CUDA. Imports nothing of app/.
"""

from __future__ import annotations

import os

# Thread names (/proc/self/task/*/comm, 15 characters at most) of runtimes that a forked child
# inherits broken: tokio's workers.
FORK_BREAKS = ("tokio-rt-worker", "tokio-runtime-w")


def threads_fork_breaks() -> list[str]:
    """Names of this process's threads that a forked child would need and not have."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # no /proc: nothing known to break
        return []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                name = handle.read().strip()
        except OSError:  # a thread that ended meanwhile
            continue
        if name.startswith(FORK_BREAKS):
            names.append(name)
    return names

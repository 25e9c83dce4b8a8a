"""Whether this process may fork a child that goes on running Python: the loader processes are
forked from their worker (they get the worker's imports and the dataset's table for free, as
pytorch/examples' loaders do), unless something here would not survive the fork.

What does not survive it is a thread the child needs and does not get: obstore's client runs
its requests on a tokio runtime, whose threads a fork does not copy; a child forked after this
process made a request through obstore hangs on its first request of its own, even through a
new client (measured with obstore 0.12.1). fsspec and s3fs start their event loop again in a
forked child, and CUDA is never used by a loader process (batches are pinned and moved by the
worker), so neither forbids the fork. Imports nothing of app/.
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

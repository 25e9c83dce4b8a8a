"""Whether a process lives, what runs below it, and dying with one's parent: Linux specifics
(/proc, prctl) where they make failure handling reliable; elsewhere the checks degrade to
os.kill(pid, 0). Imports nothing of app/."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies, so no child outlives a
    killed driver (Linux; a no-op elsewhere), even one gone before the request took effect (a
    busy machine delays a child's start): `parent` is the pid expected (by default
    multiprocessing's parent, right for fork and spawn; a forkserver's child passes the server's)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    parent = parent or getattr(multiprocessing.parent_process(), "pid", None)
    if parent and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def is_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their DataLoader workers, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found

"""Spawned processes from a script read from standard input (`python - < train.py`): a spawned
child first runs the parent's `__main__` from its `__file__`, here '<stdin>', which it cannot
open, so it would die before its first line. Without the attribute it skips `__main__`, as
under a prompt or in a notebook (the Python API then refuses objects defined in `__main__`:
app/launch/api_inputs.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def main_module_spawn_can_run() -> Iterator[None]:
    """Around the start of spawned processes (multiprocessing reads `__main__.__file__` as
    each one starts): hides a pseudo file name such as '<stdin>' meanwhile."""
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    pseudo = isinstance(path, str) and path.startswith("<")
    if pseudo:
        del main.__file__
    try:
        yield
    finally:
        if pseudo:
            main.__file__ = path

"""timm, imported without wandb.

timm imports wandb wherever it is installed (timm/utils/summary.py, for its own
`update_summary(log_wandb=True)`, which this trainer never calls): ~1.8 CPU-s of every
process that builds a model, so of every run's forkserver and of every torchrun, srun or
mpirun rank. The process's first import of timm goes through here and hides wandb from that
one import; wandb stays importable afterwards (`--logger wandb` imports it in the primary
worker). Every module of this package that uses timm imports it from here.
"""

from __future__ import annotations

import sys
from types import ModuleType


def import_timm() -> ModuleType:
    """timm; without wandb when neither was imported yet in this process."""
    if "timm" not in sys.modules and "wandb" not in sys.modules:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # Python's way to fail an import
        try:
            import timm  # noqa: PLC0415
        finally:
            del sys.modules["wandb"]
    import timm  # noqa: PLC0415
    return timm


timm = import_timm()

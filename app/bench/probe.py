"""gpu-check's first part: what the machine is (versions, GPUs, their memory now), as JSON
(`python -m app.bench.probe --json probe.json`). In a process of its own, like every part, so
the runner never holds a CUDA context."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

from app.runtime.errors import UserError

# what gpu-check needs in its interpreter, whatever the versions; parts and tests that need
# the optional packages skip themselves or say so where they are missing
REQUIRED = ("torch", "torchvision", "timm", "pandas", "fsspec", "PIL", "numpy", "tomli_w",
            "pytest")
OPTIONAL = ("nvidia.dali", "obstore", "s3fs", "tensorboard", "wandb")


def check_requirements() -> None:
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"gpu-check needs {', '.join(missing)} in this interpreter "
                        f"({sys.executable}); install them with pip")


def version_of(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 (an optional package that fails to import is absent)
        return None


def machine() -> dict:
    """What a figure was measured on: enough to tell two machines' figures apart."""
    import torch  # noqa: PLC0415
    info = Path("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                  if line.startswith("model name")), None) if info.exists() else None
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "system": platform.platform()}


def probe() -> dict:
    import torch  # noqa: PLC0415

    from app.data.decoders import dali_imports  # noqa: PLC0415
    gpus = []
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props, (free, total) = torch.cuda.get_device_properties(index), \
            torch.cuda.mem_get_info(index)
        gpus.append({"index": index, "name": props.name,
                     "capability": f"{props.major}.{props.minor}",
                     "total_gb": round(total / 2**30, 1), "free_gb": round(free / 2**30, 1)})
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), **machine(), "executable": sys.executable,
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "versions": {name: version_of(name) for name in (*REQUIRED, *OPTIONAL)},
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()
            if torch.backends.cudnn.is_available() else None,
            "gpus": gpus, "dali_imports": dali_imports()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", required=True, help="where the report goes")
    Path(parser.parse_args().json).write_text(json.dumps(probe(), indent=2))


if __name__ == "__main__":
    main()

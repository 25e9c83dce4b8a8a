"""gpu-day's first part: what the machine is (versions, GPUs, their memory now), as JSON. In a
process of its own, like every part, so the runner never holds a CUDA context.

    python -m app.bench.probe --json probe.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from app.bench.gpu_check import environment
from app.data.decoders import dali_imports


def probe() -> dict:
    import torch  # noqa: PLC0415
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), **environment(),
              "dali_imports": dali_imports()}
    for gpu in report["gpus"]:
        free, total = torch.cuda.mem_get_info(gpu["index"])
        gpu["free_gb"], gpu["total_gb"] = round(free / 2**30, 1), round(total / 2**30, 1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", required=True, help="where the report goes")
    out = Path(parser.parse_args().json)
    out.write_text(json.dumps(probe(), indent=2))


if __name__ == "__main__":
    main()

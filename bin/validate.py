#!/usr/bin/env python3
"""Top-1/top-5 of a checkpoint or an export over a dataset's whole val split: the driver's own
evaluation (driver.py -e), set up from the model's files (architecture, classes, val resize
and crop). Any further flags are the driver's.

    python bin/validate.py runs/r50/checkpoints/best.pt --dataset imagenet_local
    python bin/validate.py exports/r50 --dataset imagenet_local --val-flip-tta --gpus 8
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.runtime.cli import run_cli  # noqa: E402

USAGE = ("usage: validate.py MODEL [--dataset NAME] [--val-flip-tta] [driver.py's flags: "
         "--catalog, --devices, --gpus, -b, -j, --run-name, --output-dir, ...]")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__.strip()}")
        return 0 if argv else 2
    if argv[0].startswith("-"):
        print(f"{USAGE}\nerror: MODEL (a checkpoint or an export folder) comes first",
              file=sys.stderr)
        return 2
    from app.inference.validate import main as validate  # noqa: PLC0415 (torch: after the usage)
    return validate(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(run_cli(main))

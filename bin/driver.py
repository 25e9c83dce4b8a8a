#!/usr/bin/env python3
"""Train a ResNet on an ImageNet-format dataset from the catalog (datasets.toml).

    python bin/driver.py                                  # the generated sample dataset
    python bin/driver.py --config configs/demo.toml       # the quick demo
    python bin/driver.py --dataset imagenet_local -a resnet50 -b 256 --epochs 90
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    # First, before the seconds of imports: no moment of a run takes a stop signal's default
    # action (a stop while the run starts ends it with 75, its last checkpoint standing).
    from app.runtime.stop_signals import stop_signals
    stop_signals()

from app.runtime.cli import end_process, run_cli  # noqa: E402
from app.runtime.moments import moment  # noqa: E402


def main(argv: list[str]) -> int:
    moment("driver:importing")
    from app.launch.run import main as run  # noqa: PLC0415
    return run(argv)


if __name__ == "__main__":
    end_process(run_cli(main))

#!/usr/bin/env python3
"""Train a ResNet on an ImageNet-format dataset from the catalog (datasets.toml).

    python bin/driver.py                                  # the generated sample dataset
    python bin/driver.py --config configs/demo.toml       # the quick demo
    python bin/driver.py --dataset imagenet_local -a resnet50 -b 256 --epochs 90
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.launch.run import main  # noqa: E402
from app.runtime.cli import end_process, run_cli  # noqa: E402

if __name__ == "__main__":
    end_process(run_cli(main))

#!/usr/bin/env python3
"""Benchmarks. Every figure comes with a baseline measured in the same run.

    python bin/bench.py model -a resnet50 -b 256                  # model only, ours vs peer
    python bin/bench.py sync -a resnet50 -b 16 --devices cpu,cpu  # gradient sync modes
    python bin/bench.py loader --dataset sample_bench --dataset imagenet_s3 -j 8  # readers
    python3 bin/bench.py gpu-check                                # prove a GPU box
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.bench.cli import main  # noqa: E402
from app.runtime.cli import run_cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_cli(main))

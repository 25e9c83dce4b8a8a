#!/usr/bin/env python3
"""Draw the training curves of one run, or compare several runs in one figure.

    python bin/plot.py runs/demo                       # -> runs/demo/curves.png
    python bin/plot.py runs/a runs/b -o compare.png
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.loggers.plots import main  # noqa: E402
from app.runtime.cli import run_cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_cli(main))

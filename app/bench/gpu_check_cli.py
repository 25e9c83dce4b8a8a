"""`bin/bench.py gpu-check`: its flags (app/bench/gpu_check.py runs the parts)."""

from __future__ import annotations

import argparse

from app.bench.gpu_check import BUDGET_S, WORK


def add_gpu_check(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser(
        "gpu-check", help="prove a GPU machine end to end within a time budget (a new GPU box, "
        "a cloud image, a driver upgrade): parts in their order of value, each with its own "
        "deadline, each report written the moment it ends (--list names them; the imagenette "
        "part trains on IMAGENETTE_ROOT's photos, else on fast.ai's archive, downloaded once)")
    check.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all the "
                       f"parts (default {BUDGET_S:.0f}: every part its whole deadline and the "
                       "gpu tests about 15 minutes; from 600 the parts up to the gpu tests "
                       "keep theirs, and what is left goes to the tests, then the extras)")
    check.add_argument("--out", default="gpu-check", help="the report folder: <part>.json, "
                       "<part>.log, summary.md")
    check.add_argument("--work", default=str(WORK), help="compile caches, the generated "
                       "sample and run folders (kept out of --out)")
    check.add_argument("--archive", help="also pack the report folder into this .tar.gz after "
                       "each part")
    check.add_argument("--parts", default="", help="only these, comma-separated (bin/bench.py "
                       "gpu-check --list names them)")
    check.add_argument("--list", action="store_true", help="name the parts and their "
                       "deadlines in this budget, run nothing")
    check.add_argument("-n", "--test-processes", type=int, default=4, help="gpu test "
                       "processes sharing the GPU (needs pytest-xdist; 1 = one after the other)")
    check.add_argument("-k", "--select", default="", help="only the gpu tests matching this "
                       "pytest -k expression")
    check.add_argument("--dali-threads", type=int, default=8, help="decoding threads (-j) of "
                       "the DALI pipelines whose memory is measured")
    check.add_argument("--dali-batch", type=int, default=256, help="their batch size")
    check.add_argument("--dali-sample", default="tiny", choices=("tiny", "bench"),
                       help="the generated sample they read (bench: ImageNet-sized images; "
                       "the first batch's memory depends on it, the build's does not)")

"""`bin/bench.py upload-lag`: its flags, and the setup they ask for (app/bench/upload_lag.py
measures it). Imports nothing heavy: the bench's spawned processes import bin/bench.py too."""

from __future__ import annotations

import argparse
import os
from typing import Callable


ABOUT = ("a run folder in a bucket: seconds from a save to the bucket's last.pt naming it, "
         "idle and with every core busy, per niceness of the upload process, and how much the "
         "upload slows the busy processes (needs pip install 'moto[server]': the bucket is "
         "moto_server on loopback, on this machine)")


def add_upload_lag(commands: argparse._SubParsersAction) -> None:
    lag = commands.add_parser("upload-lag", help=ABOUT, description=ABOUT)
    lag.add_argument("--size-mb", type=float, default=189.0, help="the checkpoint's size "
                     "(189: ResNet-50 with SGD's momentum)")
    lag.add_argument("--nicenesses", default="19,10,0", help="of the upload process, "
                     "comma-separated (a run's is 0, the training's own)")
    lag.add_argument("--repeats", type=int, default=3, help="saves per niceness, idle and "
                     "loaded each")
    lag.add_argument("--loads", type=int, default=os.cpu_count() or 1, help="CPU-bound load "
                     "processes, at the bench's niceness (default: one per core)")
    lag.add_argument("--window", type=float, default=3.0, help="seconds of the load's rate "
                     "without an upload, measured before each loaded save")
    lag.add_argument("--timeout", type=float, default=600.0, help="seconds a save may take to "
                     "reach the bucket's last.pt")
    lag.add_argument("--json", help="also write the report to this file, after each niceness")


def upload_lag_setup(args: argparse.Namespace, error: Callable[[str], None]):
    """The measurement's Setup from the flags; `error` (the parser's) for a mistake."""
    from app.bench.upload_lag import Setup  # noqa: PLC0415 (imports torch and s3fs)
    try:
        nicenesses = tuple(int(value) for value in args.nicenesses.split(",") if value)
    except ValueError:
        nicenesses = ()
    if not nicenesses or not all(0 <= value <= 19 for value in nicenesses):
        error("--nicenesses: comma-separated numbers from 0 to 19")
    if args.repeats < 1 or args.loads < 1 or args.size_mb <= 0 or args.window <= 0:
        error("upload-lag: --repeats, --loads, --size-mb and --window must be positive")
    return Setup(args.size_mb, nicenesses, args.repeats, args.loads, args.window, args.timeout)

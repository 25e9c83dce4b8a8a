#!/usr/bin/env python3
"""Benchmarks. Every figure comes with a baseline measured in the same run.

    python bin/bench.py sync -a resnet50 -b 16 --devices cpu,cpu        # gradient sync modes
    python bin/bench.py loader --dataset sample_bench --dataset imagenet_s3 -j 8   # s3fs vs obstore
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cli import run_cli  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    sync = commands.add_parser("sync", help="step time: 1 worker vs N workers ps vs allreduce")
    sync.add_argument("-a", "--arch", default="resnet50")
    sync.add_argument("-b", "--batch-size", type=int, default=16, help="per worker")
    sync.add_argument("--image-size", type=int, default=64)
    sync.add_argument("--devices", default="cpu,cpu", help="worker devices, e.g. cuda:0,cuda:0")
    sync.add_argument("--steps", type=int, default=10)
    sync.add_argument("--warmup", type=int, default=3)
    sync.add_argument("--bucket-mb", type=float, default=25.0)
    sync.add_argument("--json", help="also write the report to this file")
    loader = commands.add_parser("loader", help="loader-only images/s of one or more datasets")
    loader.add_argument("--catalog", default="datasets.toml")
    loader.add_argument("--dataset", action="append", required=True,
                        help="repeat to compare datasets; ratios are to the first")
    loader.add_argument("-b", "--batch-size", type=int, default=64)
    loader.add_argument("-j", "--workers", type=int, default=4)
    loader.add_argument("--image-size", type=int, default=224)
    loader.add_argument("--batches", type=int, default=20)
    loader.add_argument("--readers", default="s3fs,obstore",
                        help="readers to compare on object-store datasets, the baseline first")
    loader.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    # torch-heavy modules load after parsing, so --help and mistakes answer at once
    if args.command == "sync":
        from app.bench import sync as bench  # noqa: PLC0415
        report = bench.run(args.arch, args.batch_size, args.image_size, args.devices.split(","),
                           args.steps, args.warmup, args.bucket_mb)
    else:
        from app.bench import loader as bench  # noqa: PLC0415
        report = bench.run(args.catalog, args.dataset, args.image_size, args.batch_size,
                           args.workers, args.batches, tuple(args.readers.split(",")))
    print(bench.format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))

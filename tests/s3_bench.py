"""Benchmark harness for object-store reads (not a test): the real parts of tests/s3.py put
together so that docs/benchmarks.md's S3 figures have a command that repeats them.

It generates (or reuses) a sample, uploads it to moto_server on loopback, puts a FaultyProxy
in front (`--latency` per request; `--remember` answers repeated GETs from memory, so the
server side costs ~the proxy alone instead of moto's ~2.6 ms of CPU per request), writes a
catalog with `local` (the sample on disk) and `s3` (the bucket through the proxy) and runs
`bin/bench.py loader` on both, with the arguments after `--`:

    python tests/s3_bench.py --sample default --latency 0.03 --remember -- \\
        -b 64 -j 1 --batches 20 --image-size 64
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import boto3
import tomli_w

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

from app.catalog import sample  # noqa: E402
from s3 import ACCESS_KEY, SECRET_KEY, FaultyProxy, MotoServer  # noqa: E402

BUCKET, PREFIX = "bench-data", "ilsvrc"


def read_everything_once(endpoint: str) -> int:
    """Every object of the bucket fetched through the proxy, so it remembers them all."""
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX):
        for item in page.get("Contents", []):
            client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
            count += 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", default="default", choices=sorted(sample.PRESETS))
    parser.add_argument("--latency", type=float, default=0.03, help="seconds per request")
    parser.add_argument("--remember", action="store_true")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then bench.py loader flags")
    args = parser.parse_args()
    os.environ.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    root = sample.ensure(sample.default_cache_dir(), args.sample, 0, print)
    server = MotoServer()
    proxy = None
    try:
        url = server.upload(root, BUCKET, PREFIX)
        proxy = FaultyProxy(server.endpoint, latency_s=args.latency, remember=args.remember)
        if args.remember:
            print(f"warming the proxy: {read_everything_once(proxy.endpoint)} objects")
        with tempfile.TemporaryDirectory() as folder:
            catalog = Path(folder) / "datasets.toml"
            catalog.write_text(tomli_w.dumps({"default": "local", "datasets": {
                "local": {"url": str(root)},
                "s3": {"url": url, "endpoint_url": proxy.endpoint, "region": "us-east-1"}}}))
            flags = [flag for flag in args.bench if flag != "--"]
            return subprocess.call([sys.executable, str(TESTS.parent / "bin" / "bench.py"),
                                    "loader", "--catalog", str(catalog), "--dataset", "local",
                                    "--dataset", "s3", *flags])
    finally:
        if proxy:
            proxy.stop()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())

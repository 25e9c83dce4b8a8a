"""Benchmark harness for object-store reads (not a test): the real parts of tests/s3.py put
together so that docs/results.md's S3 figures have a command that repeats them.

It generates (or reuses) a sample, uploads it to moto_server on loopback, puts a FaultyProxy
in front (`--latency` per request; `--remember` answers repeated GETs from memory, so the
server side costs ~the proxy alone instead of moto's ~2.6 ms of CPU per request), writes a
catalog with `local` (the sample on disk) and `s3` (the bucket through the proxy) and runs
`bin/bench.py loader` on both, with the arguments after `--`:

    python tests/s3_bench.py --sample default --latency 0.03 --remember -- \\
        -b 64 -j 1 --batches 20 --image-size 64

With `--shards`, the sample is also written as wds and parquet shards (bin/make_shards.py),
kept on disk and uploaded, and every dataset (files and shards, local and S3) is measured in a
run of its own, cold (an empty shard cache), with the requests it made counted at the proxy:
requests per image = requests / images the loader delivered (the catalog's lists included).
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
import json

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
    parser.add_argument("--shards", action="store_true", help="also wds and parquet shards")
    parser.add_argument("--shard-size", default="64MB")
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
            datasets = {"local": {"url": str(root)},
                        "s3": {"url": url, "endpoint_url": proxy.endpoint, "region": "us-east-1"}}
            if args.shards:
                datasets.update(shard_copies(root, server, proxy, Path(folder), args.shard_size))
            catalog.write_text(tomli_w.dumps({"default": "local", "datasets": datasets}))
            flags = [flag for flag in args.bench if flag != "--"]
            if not args.shards:
                return subprocess.call(bench_command(catalog, ["local", "s3"], flags))
            for name in datasets:
                before = proxy.counts["requests"]
                report = Path(folder) / f"{name}.json"
                code = subprocess.call(bench_command(catalog, [name], [*flags, "--no-peer",
                                                                       "--json", str(report)]))
                requests = proxy.counts["requests"] - before
                delivered = sum(r["images"] for r in json.loads(report.read_text())["results"])
                print(f"{name}: {requests} requests for ~{delivered} images "
                      f"({requests / max(delivered, 1):.4f} per image; files on S3 also count "
                      "the reader-alone GETs)")
                if code:
                    return code
            return 0
    finally:
        if proxy:
            proxy.stop()
        server.stop()


def bench_command(catalog: Path, datasets: list[str], flags: list[str]) -> list[str]:
    return [sys.executable, str(TESTS.parent / "bin" / "bench.py"), "loader", "--catalog",
            str(catalog), *(f for name in datasets for f in ("--dataset", name)), *flags]


def shard_copies(root: Path, server, proxy, folder: Path, shard_size: str) -> dict:
    """The sample as wds and parquet shards, local and in the bucket, each with its own empty
    shard cache."""
    from app.catalog.shard_writer import parse_size, write_shards  # noqa: PLC0415
    from app.catalog.storage import DatasetRoot  # noqa: PLC0415
    entries = {}
    for layout in ("wds", "parquet"):
        out = folder / layout
        write_shards(DatasetRoot("sample", str(root)), out, layout, parse_size(shard_size), 0)
        bucket = server.upload(out, BUCKET, f"{PREFIX}-{layout}")
        entries[f"local_{layout}"] = {"url": str(out), "layout": layout,
                                      "cache_dir": str(folder / f"cache-local-{layout}")}
        entries[f"s3_{layout}"] = {"url": bucket, "layout": layout, "region": "us-east-1",
                                   "endpoint_url": proxy.endpoint,
                                   "cache_dir": str(folder / f"cache-s3-{layout}")}
    return entries


if __name__ == "__main__":
    sys.exit(main())

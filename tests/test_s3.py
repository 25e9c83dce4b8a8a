"""S3 datasets against a real S3-compatible server (moto_server) on loopback."""

import json

import pytest

from app.catalog import Catalog
from app.data.reader import BlobReader
from app.data.sampler import ShardedBatches
from app.tables import load_tables, train_cls_list
from conftest import REPO, TINY_TRAIN_FLAGS, run_driver, skipped_rows, write_catalog
from s3 import ACCESS_KEY, SECRET_KEY, FaultyProxy


def s3_catalog(tmp_path, url, endpoint, **options):
    return write_catalog(tmp_path / "datasets.toml", {
        "s3": {"url": url, "endpoint_url": endpoint, "region": "us-east-1", **options},
        "local": {"sample": "tiny"}})


def test_s3_tables_equal_the_local_ones(tmp_path, s3_server, s3_tiny):
    catalog = Catalog.load(s3_catalog(tmp_path, s3_tiny, s3_server.endpoint))
    remote, local = load_tables(catalog.open("s3")), load_tables(catalog.open("local"))
    assert remote.train.equals(local.train) and remote.val.equals(local.val)
    assert remote.wnids == local.wnids and len(remote.train) == 320


def test_training_one_epoch_from_s3_keeps_credentials_out_of_outputs(tmp_path, s3_server,
                                                                    s3_tiny):
    catalog = s3_catalog(tmp_path, s3_tiny, s3_server.endpoint)
    result = run_driver("--catalog", str(catalog), "--dataset", "s3", *TINY_TRAIN_FLAGS,
                        "--epochs", "1", "-j", "1", "--run-name", "s3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "s3"
    epoch = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert epoch["val/images"] == 100 and epoch["train/images"] == 320
    outputs = result.stdout + result.stderr + "".join(
        p.read_text(errors="replace") for p in run_dir.rglob("*") if p.suffix in (".toml",
                                                                                   ".jsonl"))
    assert SECRET_KEY not in outputs and ACCESS_KEY not in outputs
    assert "s3" in (run_dir / "config.toml").read_text()


def test_many_requests_in_flight(tmp_path, s3_server, s3_tiny, tiny_sample):
    """+0.5 s per request, counted by the proxy: one GET after the other would have 1 in flight,
    botocore's default connection pool at most 10; the reader keeps most of a batch in flight."""
    proxy = FaultyProxy(s3_server.endpoint, latency_s=0.5)
    try:
        catalog = Catalog.load(s3_catalog(tmp_path, s3_tiny, proxy.endpoint))
        root = catalog.open("s3")
        paths = list(train_cls_list(root).path)
        before = proxy.counts["requests"]  # the catalog and the table have been read
        blobs = BlobReader(root).read_many(paths[:64])
        assert len(blobs) == 64 and all(data and not reason for data, reason in blobs)
        assert blobs[5][0] == (tiny_sample / paths[5]).read_bytes()
        counts = proxy.counts
    finally:
        proxy.stop()
    assert counts["requests"] - before == 64  # one GET per object, no HEAD first
    # Not a timing: requests overlap if and only if they are in flight together.
    assert counts["most_in_flight"] >= 32, counts


def test_faults_are_retried_and_lost_images_counted(tmp_path, s3_server, tiny_sample):
    """503s and dropped connections on a share of requests; two objects that always fail and
    one that was deleted: training completes and every image is read or counted skipped."""
    url = s3_server.upload(tiny_sample, "imagenet-faults", "ilsvrc")
    frame = train_cls_list(Catalog.load(s3_catalog(tmp_path, url, s3_server.endpoint))
                           .open("s3"))
    # Damage images of the first train batch, so their (bounded) retries overlap in time.
    batch = 128  # few large batches: the faults of a batch are retried concurrently
    first_batch = [index for index, _ in next(iter(ShardedBatches(len(frame), batch, seed=0)))]
    failing = tuple(frame.path[first_batch[:2]])
    deleted = frame.path[first_batch[2]]
    s3_server.client().delete_object(Bucket="imagenet-faults", Key=f"ilsvrc/{deleted}")
    proxy = FaultyProxy(s3_server.endpoint, latency_s=0.01, fail_fraction=0.05,
                        drop_fraction=0.05, always_fail=failing)
    try:
        catalog = s3_catalog(tmp_path, url, proxy.endpoint)
        result = run_driver("--catalog", str(catalog), "--dataset", "s3", *TINY_TRAIN_FLAGS,
                            "-b", str(batch), "--epochs", "1", "-j", "0", "--run-name", "faults", cwd=tmp_path,
                            timeout=400)
        counts = proxy.counts
    finally:
        proxy.stop()
    assert result.returncode == 0, result.stderr
    assert counts["failed"] > 20 and counts["dropped"] > 10, counts  # faults did happen
    run_dir = tmp_path / "runs" / "faults"
    epoch = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert epoch["train/images"] + epoch["train/skipped"] == 320
    assert epoch["train/skipped"] == 3 and epoch["val/images"] + epoch["val/skipped"] == 100
    skipped = {row["path"]: row["reason"] for row in skipped_rows(run_dir)}
    assert set(skipped) == {*failing, deleted}
    assert skipped[deleted] == "missing"
    assert all(skipped[path].startswith("unreadable after 3 attempts") for path in failing)


def test_local_cache_serves_later_epochs_and_stays_bounded(tmp_path, s3_server, s3_tiny):
    proxy = FaultyProxy(s3_server.endpoint)
    limit_gb = 0.6 / 1024  # 0.6 MB of the 1.8 MB sample
    try:
        catalog = Catalog.load(s3_catalog(tmp_path, s3_tiny, proxy.endpoint,
                                          cache_dir=str(tmp_path / "cache"),
                                          cache_max_gb=limit_gb))
        root = catalog.open("s3")
        paths = list(train_cls_list(root).path)
        first = proxy.counts["requests"]
        epoch1 = BlobReader(root).read_many(paths)
        after_first = proxy.counts["requests"]
        epoch2 = BlobReader(root).read_many(paths)
        after_second = proxy.counts["requests"]
    finally:
        proxy.stop()
    assert epoch1 == epoch2 and all(data for data, _ in epoch2)
    cache = BlobReader(root).cache
    cached = [p for p in paths if cache.get(p) is not None]
    assert 0 < len(cached) < len(paths)
    assert cache.used_bytes() <= limit_gb * 2**30
    assert sum(len(cache.get(p)) for p in cached) == cache.used_bytes()
    assert after_first - first == len(paths)
    assert after_second - after_first == len(paths) - len(cached)  # only the uncached ones


def test_unreachable_endpoint_is_a_clear_error(tmp_path, s3_server, capsys):
    from app.cli import run_cli
    from app.run import main
    catalog = s3_catalog(tmp_path, "s3://imagenet-test/ilsvrc", "http://127.0.0.1:9",
                         concurrency=4)
    code = run_cli(main, ["--catalog", str(catalog), "--dataset", "s3"])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert message.startswith("error: dataset 's3': cannot reach s3://imagenet-test/ilsvrc")
    assert "endpoint_url" in message


def test_bench_reports_loader_speed_of_s3_beside_local(tmp_path, s3_server, s3_tiny):
    import subprocess
    import sys
    catalog = s3_catalog(tmp_path, s3_tiny, s3_server.endpoint)
    report = tmp_path / "loader.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bin" / "bench.py"), "loader", "--catalog", str(catalog),
         "--dataset", "local", "--dataset", "s3", "-b", "32", "-j", "1", "--batches", "6",
         "--image-size", "32", "--json", str(report)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = json.loads(report.read_text())["results"]
    assert [r["dataset"] for r in rows] == ["local", "s3"]
    assert all(r["images_per_s"] > 0 and r["images"] == 6 * 32 for r in rows)
    assert rows[1]["ratio_to_first"] == pytest.approx(rows[1]["images_per_s"] /
                                                      rows[0]["images_per_s"])
    assert "s3" in result.stdout and "images/s" in result.stdout

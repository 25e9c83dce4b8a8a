"""S3 datasets against a real S3-compatible server (moto_server) on loopback: read through
obstore (the default) or s3fs, in the Kaggle and the ImageFolder layout."""

import itertools
import json

import pytest
import torch

from app.catalog import Catalog
from app.catalog.retry import ATTEMPTS, OBSTORE_RETRY, WAITS_S
from app.catalog.storage import DatasetRoot
from app.catalog.tables import SYNSET_MAPPING, TRAIN_CLS, load_tables, train_cls_list
from app.config.sources import parse_config
from app.data.augment import TrainRecipe
from app.data.pillow_pipeline import READ_AHEAD_BATCHES, build_loader
from app.data.reader import BlobReader
from app.data.sampler import ShardedBatches
from app.launch.run import prepare_job
from app.training import preflight
from conftest import REPO, TINY_TRAIN_FLAGS, run_driver, run_tool, skipped_rows, write_catalog

for needed in ("boto3", "obstore", "s3fs"):  # machines without them (gpu-check) skip these
    pytest.importorskip(needed)
from s3 import ACCESS_KEY, SECRET_KEY, FaultyProxy  # noqa: E402


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


@pytest.mark.parametrize("reader", ["obstore", "s3fs"])
def test_many_requests_in_flight(tmp_path, s3_server, s3_tiny, tiny_sample, reader):
    """+0.5 s per request, counted by the proxy: one GET after the other would have 1 in flight,
    botocore's default connection pool at most 10; the reader keeps most of a batch in flight."""
    proxy = FaultyProxy(s3_server.endpoint, latency_s=0.5)
    try:
        catalog = Catalog.load(s3_catalog(tmp_path, s3_tiny, proxy.endpoint, reader=reader))
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
    for path in failing:
        assert skipped[path].startswith(f"unreadable after {ATTEMPTS} attempts"), skipped[path]
        assert "503" in skipped[path] and "SlowDown" in skipped[path]
    # A failing object's cost is bounded by requests, each answered at once here: obstore's
    # tries of its one GET (the one retry policy), and nothing else (s3fs once made 24 of them,
    # 24 s in all). With their waits at most, that is under 2.5 s of its batch.
    assert counts["always_failed"] == len(failing) * ATTEMPTS, counts
    assert OBSTORE_RETRY["max_retries"] == ATTEMPTS - 1 == len(WAITS_S)
    assert OBSTORE_RETRY["backoff"]["max_backoff"].total_seconds() == WAITS_S[-1]
    assert sum(WAITS_S) <= 4.0


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


def test_next_batches_are_in_flight_while_one_decodes_and_batches_stay_the_same(
        tmp_path, s3_server, s3_tiny):
    """+0.3 s per request, counted by the proxy: a loader that read batch after batch would
    have at most one batch (8) in flight; reading ahead, the next two batches' requests are in
    flight with it. What it delivers is exactly the local copy's batches (same images, order,
    crops), resumed mid-epoch."""
    proxy = FaultyProxy(s3_server.endpoint, latency_s=0.3)
    try:
        catalog = Catalog.load(s3_catalog(tmp_path, s3_tiny, proxy.endpoint))
        remote, local = catalog.open("s3"), catalog.open("local")
        frame = train_cls_list(local)

        def first_batches(root):
            batches = ShardedBatches(len(frame), 8, seed=3)
            loader = build_loader(root, frame, TrainRecipe(16), batches, workers=0)
            batches.set_epoch(2, start_step=5)
            return [(b.images, b.labels, b.skipped) for b in itertools.islice(loader, 4)]

        got = first_batches(remote)
        counts = proxy.counts
    finally:
        proxy.stop()
    assert remote.reader == "obstore" and READ_AHEAD_BATCHES == 2
    assert counts["most_in_flight"] > 2 * 8, counts
    want = first_batches(local)
    for (images, labels, skipped), (images_local, labels_local, _) in zip(got, want):
        assert torch.equal(images, images_local) and torch.equal(labels, labels_local)
        assert skipped == []


def test_an_imagefolder_bucket_opens_like_the_local_copy(tmp_path, s3_server, tiny_imagefolder):
    """The ImageFolder layout in a bucket: the same tables as the local copy (listing through
    s3fs), --classes selects among the folders, pre-flight passes, and the reads are the
    files' bytes."""
    url = s3_server.upload(tiny_imagefolder, "imagenet-folders", "copy")
    catalog = s3_catalog(tmp_path, url, s3_server.endpoint, layout="imagefolder")
    config, _ = parse_config(["--catalog", str(catalog), "--dataset", "s3", "--classes", "3",
                              "--output-dir", str(tmp_path / "runs"), "--run-name", "folders"])
    job = prepare_job(config)
    local = load_tables(DatasetRoot("local", str(tiny_imagefolder), layout="imagefolder"), 3)
    assert job.tables.train.equals(local.train) and job.tables.val.equals(local.val)
    assert job.tables.wnids == local.wnids and len(job.tables.train) == 3 * 32
    preflight.check(job, saves=False)
    paths = list(job.tables.val.path[:5])
    blobs = BlobReader(job.root).read_many(paths)
    assert [data for data, _ in blobs] == [(tiny_imagefolder / p).read_bytes() for p in paths]


def test_profile_credentials_sign_the_requests_and_anon_sends_none(tmp_path, s3_server, s3_tiny,
                                                                   tiny_sample, monkeypatch):
    """`profile =` takes the profile's keys through boto3's chain (not the environment's),
    for the tables (s3fs) and the images (obstore) alike; `anon = true` signs nothing (on a
    bucket that anyone may read)."""
    images = list(train_cls_list(DatasetRoot("local", str(tiny_sample))).path[:8])
    public = s3_server.upload(tiny_sample, "imagenet-public", "ilsvrc", acl="public-read",
                              only=[SYNSET_MAPPING, TRAIN_CLS, *images])
    profile_key = "AKIAIMAGENETDPPROFILE"
    (tmp_path / "config").write_text("[profile research]\nregion = us-east-1\n")
    (tmp_path / "credentials").write_text(f"[research]\naws_access_key_id = {profile_key}\n"
                                          "aws_secret_access_key = profile-secret\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    proxy = FaultyProxy(s3_server.endpoint)
    try:
        seen = {}
        for name, url, options in [("profile", s3_tiny, {"profile": "research"}),
                                   ("anon", public, {"anon": True})]:
            catalog = Catalog.load(s3_catalog(tmp_path, url, proxy.endpoint, **options))
            root = catalog.open("s3")
            paths = list(train_cls_list(root).path[:8])
            assert paths == images
            before = proxy.counts
            blobs = BlobReader(root).read_many(paths)
            after = proxy.counts
            assert all(data for data, _ in blobs), blobs
            seen[name] = ({k: n - before["signed_by"].get(k, 0)
                           for k, n in after["signed_by"].items()
                           if n > before["signed_by"].get(k, 0)},
                          after["unsigned"] - before["unsigned"])
    finally:
        proxy.stop()
    assert seen["profile"] == ({profile_key: 8}, 0)
    assert seen["anon"] == ({}, 8)


def test_unreachable_endpoint_is_a_clear_error(tmp_path, s3_server, capsys, monkeypatch):
    from app.launch.run import main
    from app.runtime.cli import run_cli
    # one try: the message is what is tested; botocore's waits between tries (up to 1, 2, 4
    # and 8 s) are its own, and would only make the test wait
    monkeypatch.setattr("app.catalog.catalog.BOTOCORE_RETRIES", {"max_attempts": 1,
                                                                  "mode": "standard"})
    catalog = s3_catalog(tmp_path, "s3://imagenet-test/ilsvrc", "http://127.0.0.1:9",
                         concurrency=4)
    code = run_cli(main, ["--catalog", str(catalog), "--dataset", "s3"])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert message.startswith("error: dataset 's3': cannot reach s3://imagenet-test/ilsvrc")
    assert "endpoint_url" in message


def test_bench_reports_loader_speed_of_s3_beside_local(tmp_path, s3_server, s3_tiny):
    catalog = s3_catalog(tmp_path, s3_tiny, s3_server.endpoint)
    report = tmp_path / "loader.json"
    result = run_tool("bench.py", "loader", "--catalog", catalog, "--dataset", "local",
                      "--dataset", "s3", "-b", "32", "-j", "0", "--batches", "4",
                      "--image-size", "32", "--json", report, cwd=REPO)
    assert result.returncode == 0, result.stderr
    rows = json.loads(report.read_text())["results"]
    # the S3 dataset once per reader, today's s3fs path first: the baseline of the others
    assert [(r["dataset"], r["reader"]) for r in rows] == [
        ("local", "fsspec"), ("s3", "s3fs"), ("s3", "obstore")]
    assert all(r["images_per_s"] > 0 and r["images"] == 4 * 32 for r in rows)
    assert all(r["cpu_ms_per_image"] > 0 and r["gets"] == 4 * 32 for r in rows)
    assert rows[1]["ratio_to_first"] == pytest.approx(rows[1]["images_per_s"] /
                                                      rows[0]["images_per_s"])
    assert rows[2]["cpu_per_get_vs_baseline"] == pytest.approx(rows[2]["cpu_ms_per_get"] /
                                                               rows[1]["cpu_ms_per_get"])
    assert "s3" in result.stdout and "images/s" in result.stdout and "CPU ms/GET" in result.stdout

"""The one fetcher of whole remote files (app/catalog/fetcher.py), where the tests of its users
(test_archive.py: cuts, 404s, checksums, full disks; test_shards.py; test_pretrained.py,
test_predict.py, test_remote_output.py: models and checkpoints at URLs) leave a part of it
untested: its own lock, a file fetched again when its source's version changes (a local file,
S3 through fsspec and through obstore, a web server that says only the size), and obstore's
ranged GET, which continues only a cut download of the same version."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import obstore
import pytest

from app.catalog import fetcher, versions
from app.catalog.storage import DatasetRoot, Location
from conftest import REPO
from test_archive import server  # noqa: F401 (the loopback HTTP server fixture, shared)

FETCH_IN_A_PROCESS = """
import sys
from app.catalog.fetcher import fetch
from app.catalog.storage import Location
print(fetch(Location(sys.argv[1]), "models", cache=sys.argv[2],
            report=lambda line: print(line, flush=True)), flush=True)
"""


def gets(server, name: str) -> int:
    return sum(r["path"] == f"/{name}" and r["method"] == "GET" for r in server.requests())


def test_processes_asking_at_once_fetch_once(server, tmp_path):
    """The test holds the file's lock while two processes start, so both must wait for it (no
    timing luck); then one downloads and the other finds the file there."""
    body = random.Random(1).randbytes(300_000)
    (server.folder / "step-4.pt").write_bytes(body)
    url = server.url("step-4.pt")
    local = fetcher.cached_path(url, "models", tmp_path)
    local.parent.mkdir(parents=True)
    with fetcher.machine_lock(local):
        processes = [subprocess.Popen([sys.executable, "-c", FETCH_IN_A_PROCESS, url,
                                       str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for process in processes:
            assert process.stdout.readline().startswith(
                f"waiting for another process that downloads {url} into {local}")
    results = [process.communicate(timeout=60) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], results
    assert [out.splitlines()[-1] for out, _ in results] == [str(local)] * 2
    assert local.read_bytes() == body and gets(server, "step-4.pt") == 1
    assert sorted(p.name for p in local.parent.iterdir()) == [
        ".step-4.pt.lock", ".step-4.pt.version", "step-4.pt"]


def test_a_server_that_says_no_version_has_its_file_fetched_again_when_its_size_changes(
        server, tmp_path):
    """The loopback server sends neither ETag nor Last-Modified: the size alone tells. While the
    file stays, a later fetch asks only for its size (a HEAD request)."""
    path = server.folder / "last.pt"
    path.write_bytes(b"a" * 1000)
    source = Location(server.url("last.pt"))
    assert fetcher.fetch(source, "models", cache=tmp_path).read_bytes() == b"a" * 1000
    assert fetcher.fetch(source, "models", cache=tmp_path).read_bytes() == b"a" * 1000
    assert gets(server, "last.pt") == 1
    path.write_bytes(b"b" * 2000)
    assert fetcher.fetch(source, "models", cache=tmp_path).read_bytes() == b"b" * 2000
    assert gets(server, "last.pt") == 2


def test_obstore_continues_a_cut_fetch_of_the_same_version_and_names_a_missing_file(
        s3_server, tmp_path):
    """A dataset entry that reads with obstore (shards) fetches through it too. The planted
    .part holds bytes the object does not, so the file shows that only the rest travelled;
    planted as a cut of an earlier version of the same size, it is downloaded whole instead."""
    body = random.Random(2).randbytes(3 << 20)
    client = s3_server.client()
    client.create_bucket(Bucket="fetched")
    client.put_object(Bucket="fetched", Key="d/shard-0.tar", Body=body)
    root = DatasetRoot("d", "s3://fetched/d", {"endpoint_url": s3_server.endpoint},
                       store_options={"endpoint_url": s3_server.endpoint, "region": "us-east-1"})
    assert root.reader == "obstore"
    local = fetcher.cached_path(root.describe("shard-0.tar"), "shards", tmp_path)
    local.parent.mkdir(parents=True)
    part, kept = fetcher.hidden(local, "part"), len(body) // 3
    for version in ("now", "before"):
        part.write_bytes(b"\0" * kept)
        current = versions.version_of(obstore.head(root.store, "shard-0.tar"))
        versions.remember(local, part=current if version == "now" else versions.Version(
            current.size, '"an earlier ETag"'))
        local.unlink(missing_ok=True)
        assert fetcher.fetch(root, "shards", "shard-0.tar", cache=tmp_path) == local
        assert local.read_bytes() == (b"\0" * kept + body[kept:] if version == "now" else body)
        assert not part.exists()
    with pytest.raises(fetcher.NotFound) as missing:
        fetcher.fetch(root, "shards", "gone.tar", cache=tmp_path)
    assert str(missing.value) == "s3://fetched/d/gone.tar not found; check the URL"

def test_a_local_file_replaced_by_one_of_the_same_size_is_fetched_again(tmp_path):
    """A plain local file says its modification time and size: a newer one of the same size
    is a new version. A cached copy changed in the cache is fetched again too."""
    source = tmp_path / "runs" / "last.pt"
    source.parent.mkdir()
    source.write_bytes(b"a" * 1000)
    os.utime(source, ns=(10**18, 10**18))
    cache = tmp_path / "cache"
    local = fetcher.fetch(Location(str(source)), "models", cache=cache)
    assert local.read_bytes() == b"a" * 1000
    source.write_bytes(b"b" * 1000)
    os.utime(source, ns=(10**18 + 10**6, 10**18 + 10**6))  # a millisecond later
    assert fetcher.fetch(Location(str(source)), "models", cache=cache).read_bytes() == b"b" * 1000
    local.write_bytes(b"c" * 1000)  # not the source's bytes any more, whatever the sidecar says
    assert fetcher.fetch(Location(str(source)), "models", cache=cache).read_bytes() == b"b" * 1000


@pytest.mark.parametrize("reader", ["fsspec", "obstore"])
def test_an_object_replaced_by_one_of_the_same_size_is_fetched_again(s3_server, tmp_path, reader):
    """S3's ETag names the version: a checkpoint replaced by a newer one of the same size (as a
    run's last.pt is) is downloaded again; the same one again is not (one HEAD, no GET)."""
    client = s3_server.client()
    client.create_bucket(Bucket=f"same-size-{reader}")
    client.put_object(Bucket=f"same-size-{reader}", Key="r/last.pt", Body=b"a" * 5000)
    url = f"s3://same-size-{reader}/r"
    if reader == "obstore":  # a dataset's shard
        source = DatasetRoot("d", url, store_options={"endpoint_url": s3_server.endpoint,
                                                      "region": "us-east-1"})
    else:  # --resume URL: any file at a URL
        source = Location(url, {"endpoint_url": s3_server.endpoint})
    assert source.reader == reader
    first = fetcher.fetch(source, "models", "last.pt", cache=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert fetcher.fetch(source, "models", "last.pt", cache=tmp_path).stat().st_mtime_ns == mtime
    client.put_object(Bucket=f"same-size-{reader}", Key="r/last.pt", Body=b"b" * 5000)
    assert fetcher.fetch(source, "models", "last.pt", cache=tmp_path).read_bytes() == b"b" * 5000

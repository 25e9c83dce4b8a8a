"""The one fetcher of whole remote files (app/catalog/fetcher.py), where the tests of its users
(test_archive.py: cuts, 404s, checksums, full disks; test_shards.py; test_pretrained.py,
test_predict.py, test_remote_output.py: models and checkpoints at URLs) leave a part of it
untested: its own lock, a file fetched again when it changes, and obstore's ranged GET."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from app.catalog import fetcher
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
    with FileLock(f"{local}.lock"):
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
    assert sorted(p.name for p in local.parent.iterdir()) == ["step-4.pt", "step-4.pt.lock"]


def test_a_file_without_a_checksum_is_fetched_again_when_its_size_changes(server, tmp_path):
    """A run's last.pt is replaced as the run trains: the cached copy follows it; while it
    stays, a later fetch asks only for its size."""
    path = server.folder / "last.pt"
    path.write_bytes(b"a" * 1000)
    source = Location(server.url("last.pt"))
    assert fetcher.fetch(source, "models", cache=tmp_path).read_bytes() == b"a" * 1000
    assert fetcher.fetch(source, "models", cache=tmp_path).read_bytes() == b"a" * 1000
    assert gets(server, "last.pt") == 1
    path.write_bytes(b"b" * 2000)
    assert fetcher.fetch(source, "models", cache=tmp_path).read_bytes() == b"b" * 2000
    assert gets(server, "last.pt") == 2


def test_obstore_continues_a_cut_fetch_with_a_ranged_get_and_names_a_missing_file(
        s3_server, tmp_path):
    """A dataset entry that reads with obstore (shards) fetches through it too. The planted
    .part holds bytes the object does not, so the file shows that only the rest travelled."""
    body = random.Random(2).randbytes(3 << 20)
    client = s3_server.client()
    client.create_bucket(Bucket="fetched")
    client.put_object(Bucket="fetched", Key="d/shard-0.tar", Body=body)
    root = DatasetRoot("d", "s3://fetched/d", {"endpoint_url": s3_server.endpoint},
                       store_options={"endpoint_url": s3_server.endpoint, "region": "us-east-1"})
    assert root.reader == "obstore"
    local = fetcher.cached_path(root.describe("shard-0.tar"), "shards", tmp_path)
    local.parent.mkdir(parents=True)
    kept = len(body) // 3
    Path(f"{local}.part").write_bytes(b"\0" * kept)
    assert fetcher.fetch(root, "shards", "shard-0.tar", cache=tmp_path) == local
    assert local.read_bytes() == b"\0" * kept + body[kept:]
    assert not Path(f"{local}.part").exists()
    with pytest.raises(fetcher.NotFound) as missing:
        fetcher.fetch(root, "shards", "gone.tar", cache=tmp_path)
    assert str(missing.value) == "s3://fetched/d/gone.tar not found; check the URL"

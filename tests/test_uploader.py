"""The uploader's rules, on fsspec's in-memory filesystem (the S3 server's tests are in
tests/test_remote_output.py): last.pt moves only to a step file whose upload completed, the
bucket keeps --keep step files, a failing file is said once and tried again, and
Catalog.location takes the settings of the entry in the same bucket."""

import os

import pytest

from app.catalog import Catalog
from app.catalog.remote_run import RemoteRunFolder
from app.catalog.storage import DatasetRoot
from app.catalog.uploader import Uploader
from conftest import write_catalog


@pytest.fixture
def remote(tmp_path):
    url = f"memory://bucket/{tmp_path.name}/run"
    return RemoteRunFolder(DatasetRoot("run", url))


def save(folder, step: int, data: bytes) -> None:
    """What CheckpointFolder.save leaves: step-N.pt, and last.pt as another name of it."""
    checkpoints = folder / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    path = checkpoints / f"step-{step:09d}.pt"
    path.write_bytes(data)
    (checkpoints / "last.pt").unlink(missing_ok=True)
    os.link(path, checkpoints / "last.pt")


def stored(remote) -> dict[str, bytes]:
    return {name: remote.root.read_bytes(name) for name in remote.files()}


class Refusing(RemoteRunFolder):
    """A bucket whose writes of checkpoints are refused until `allow` is set."""
    allow = False

    def put(self, local, relative, deadline=None):
        if "checkpoints/" in relative and not self.allow:
            raise PermissionError("Access Denied")
        super().put(local, relative, deadline)


def test_last_pt_follows_only_whole_uploads_and_the_bucket_keeps_keep(tmp_path, remote):
    local, said = tmp_path / "staged", []
    (local / "metrics.jsonl").parent.mkdir(parents=True)
    (local / "metrics.jsonl").write_text('{"step": 1}\n')
    uploader = Uploader(local, remote, keep=2, report=said.append)
    for step in (1, 2, 3):
        save(local, step, f"checkpoint {step}".encode())
        uploader._pass(final=False)
        files = stored(remote)
        assert files["checkpoints/last.pt"] == f"checkpoint {step}".encode()
    assert sorted(k for k in files if "step-" in k) == ["checkpoints/step-000000002.pt",
                                                       "checkpoints/step-000000003.pt"]
    assert files["metrics.jsonl"] == b'{"step": 1}\n'
    assert sum("uploaded checkpoints/step-" in line for line in said) == 3


def test_a_refused_checkpoint_is_said_once_stays_local_and_goes_up_once_allowed(tmp_path):
    remote = Refusing(DatasetRoot("run", f"memory://bucket/{tmp_path.name}/refused"))
    local, said = tmp_path / "staged", []
    uploader = Uploader(local, remote, keep=3, report=said.append)
    save(local, 1, b"one")
    for _ in range(3):
        uploader._pass(final=True)  # a final pass tries again at once
    assert [line for line in said if "could not upload" in line] == [
        f"could not upload checkpoints/step-000000001.pt to {remote.url} (403 access denied: "
        f"Access Denied); it stays in {local}/checkpoints/step-000000001.pt; training goes on "
        "and the upload is tried again; the bucket's last.pt still names the checkpoint it "
        "named before"]
    assert "checkpoints/last.pt" not in remote.files()
    assert uploader.waiting() == ["checkpoints/step-000000001.pt"]
    remote.allow = True
    uploader._pass(final=True)
    assert stored(remote)["checkpoints/last.pt"] == b"one" and uploader.waiting() == []
    assert any("after all: uploads work again" in line for line in said)


def test_the_output_url_takes_the_settings_of_the_catalog_entry_in_its_bucket(tmp_path):
    catalog = Catalog.load(write_catalog(tmp_path / "datasets.toml", {
        "sample": {"sample": "tiny"},
        "data": {"url": "s3://shared/imagenet", "endpoint_url": "http://one:9000"},
        "deeper": {"url": "s3://shared/runs/team", "endpoint_url": "http://two:9000",
                   "region": "eu-west-1", "profile": "team"},
        "other": {"url": "s3://elsewhere/x", "anon": True}}))
    deeper = catalog.location("s3://shared/runs/team/r1")
    assert deeper.storage_options["endpoint_url"] == "http://two:9000"
    assert deeper.storage_options["profile"] == "team"
    assert deeper.store_options == {"endpoint_url": "http://two:9000", "region": "eu-west-1",
                                    "profile": "team"}
    assert catalog.location("s3://shared/imagenet-runs/r1").storage_options[
        "endpoint_url"] == "http://one:9000"
    alone = catalog.location("s3://nobody/runs/r1")  # the credential chain's settings only
    assert "endpoint_url" not in alone.storage_options and alone.store_options == {}

"""The upload process's rules, on fsspec's in-memory filesystem (the S3 server's tests are in
tests/test_remote_output.py): it uploads what it is told, the newest checkpoint first; last.pt
moves only to a step file whose upload completed; the bucket keeps --keep step files; a failing
upload or delete is said once and tried again; best.pt reaches the bucket where the file system
has no hard links; Catalog.location takes the settings of the entry in the same bucket."""

import os
import queue
import time

import pytest
import torch

from app.catalog import Catalog
from app.catalog.remote_run import RemoteRunFolder
from app.catalog.storage import DatasetRoot
from app.catalog.uploader import Finish, Record, Saved, UploadProcess, Uploader
from app.training.checkpoint import CheckpointFolder
from conftest import write_catalog


@pytest.fixture
def remote(tmp_path):
    return RemoteRunFolder(DatasetRoot("run", f"memory://bucket/{tmp_path.name}/run"))


def save(folder, step: int, data: bytes, best: bool = False) -> Saved:
    """What CheckpointFolder.save leaves and says: step-N.pt, and last.pt naming it."""
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    (folder / f"checkpoints/step-{step:09d}.pt").write_bytes(data)
    pointers = ("checkpoints/last.pt", *(("checkpoints/best.pt",) if best else ()))
    return Saved(f"checkpoints/step-{step:09d}.pt", pointers)


def told(uploader: Uploader, *messages):
    """Runs the uploader over `messages`, then Finish, to its answer."""
    inbox = queue.SimpleQueue()
    for message in (*messages, Finish(time.monotonic() + 60)):
        inbox.put(message)
    return uploader.run(inbox)


def stored(remote) -> dict[str, bytes]:
    return {name: remote.root.read_bytes(name) for name in remote.sizes()}


class Refusing(RemoteRunFolder):
    """A bucket that refuses writes of checkpoints, and deletes, until `allow` is set; records
    the order of its uploads."""
    allow = False

    def __init__(self, root):
        super().__init__(root)
        self.puts = []

    def put(self, local, relative):
        if "checkpoints/" in relative and not self.allow:
            raise PermissionError("Access Denied")
        self.puts.append(relative)
        super().put(local, relative)

    def delete(self, relative):
        if not self.allow:
            raise PermissionError("Access Denied")
        super().delete(relative)


def test_last_pt_follows_only_whole_uploads_and_the_bucket_keeps_keep(tmp_path, remote):
    local, said = tmp_path / "staged", []
    local.mkdir()
    (local / "metrics.jsonl").write_text('{"step": 1}\n')
    remote.root.fs.pipe(remote.root.path("checkpoints/step-000000000.pt"), b"earlier machine")
    uploader = Uploader(local, remote, keep=2, report=said.append).start()
    for step in (1, 2, 3):
        mirrored = told(uploader, save(local, step, f"checkpoint {step}".encode()),
                        Record(("metrics.jsonl",)))
        files = stored(remote)
        assert files["checkpoints/last.pt"] == f"checkpoint {step}".encode()
        assert not mirrored.waiting and mirrored.newest_named
    assert sorted(k for k in files if "step-" in k) == ["checkpoints/step-000000002.pt",
                                                       "checkpoints/step-000000003.pt"]
    assert files["metrics.jsonl"] == b'{"step": 1}\n'
    assert sum("uploaded checkpoints/step-" in line for line in said) == 3


def test_the_newest_checkpoint_goes_first_and_older_ones_beyond_keep_not_at_all(tmp_path):
    remote = Refusing(DatasetRoot("run", f"memory://bucket/{tmp_path.name}/order"))
    remote.allow = True
    local = tmp_path / "staged"
    uploader = Uploader(local, remote, keep=2, report=lambda _: None).start()
    (local / "curves.png").parent.mkdir(parents=True, exist_ok=True)
    saves = [save(local, step, b"x" * step) for step in (1, 2, 3)]
    (local / "curves.png").write_bytes(b"png")
    told(uploader, *saves, Record(("curves.png",)))
    assert remote.puts == ["checkpoints/step-000000003.pt", "curves.png",
                           "checkpoints/step-000000002.pt"]
    assert stored(remote)["checkpoints/last.pt"] == b"xxx"


def test_a_refused_checkpoint_is_said_once_stays_local_and_goes_up_once_allowed(tmp_path):
    remote = Refusing(DatasetRoot("run", f"memory://bucket/{tmp_path.name}/refused"))
    local, said = tmp_path / "staged", []
    uploader = Uploader(local, remote, keep=3, report=said.append).start()
    first = told(uploader, save(local, 1, b"one"))
    second = told(uploader)  # a Finish tries again at once
    assert [line for line in said if "could not upload" in line] == [
        f"could not upload checkpoints/step-000000001.pt to {remote.url} (403 access denied: "
        f"Access Denied); it stays in {local}/checkpoints/step-000000001.pt; training goes on "
        "and the upload is tried again; the bucket's last.pt still names the checkpoint it "
        "named before"]
    assert "checkpoints/last.pt" not in remote.sizes()
    assert first.waiting == second.waiting == ("checkpoints/step-000000001.pt",)
    assert not second.newest_named and second.newest == "checkpoints/step-000000001.pt"
    remote.allow = True
    assert not told(uploader).waiting
    assert stored(remote)["checkpoints/last.pt"] == b"one"
    assert any("after all: uploads work again" in line for line in said)


def test_a_failed_upload_waits_for_its_retry_then_goes_up_without_a_finish(tmp_path, monkeypatch):
    """Between saves the process waits for a message or for the next try, nothing else: the
    retry comes after RETRY_WAITS_S (shortened here), with no new message."""
    monkeypatch.setattr("app.catalog.uploader.RETRY_WAITS_S", (0.0,))
    remote = Refusing(DatasetRoot("run", f"memory://bucket/{tmp_path.name}/retry"))
    local, said = tmp_path / "staged", []
    uploader = Uploader(local, remote, keep=3, report=said.append).start()
    inbox = queue.SimpleQueue()
    put, copy = remote.put, remote.copy

    def allowed_after_one_refusal(*args, **kwargs):
        remote.allow = bool(said)
        return put(*args, **kwargs)

    def copy_then_no_sender_left(*args, **kwargs):
        copy(*args, **kwargs)
        inbox.put(None)

    remote.put, remote.copy = allowed_after_one_refusal, copy_then_no_sender_left
    inbox.put(save(local, 1, b"one"))
    assert uploader.run(inbox) is None  # no Finish: every sender went
    assert stored(remote)["checkpoints/last.pt"] == b"one"
    assert [line.split(" (")[0] for line in said] == [
        "could not upload checkpoints/step-000000001.pt to " + remote.url,
        "uploaded checkpoints/step-000000001.pt", f"{remote.url}/checkpoints/step-000000001.pt "
        "is in the bucket after all: uploads work again"]


def test_a_failed_delete_is_said_once_and_done_at_a_later_save(tmp_path):
    remote = Refusing(DatasetRoot("run", f"memory://bucket/{tmp_path.name}/undeleted"))
    remote.put = lambda local, relative: RemoteRunFolder.put(
        remote, local, relative)  # uploads pass, deletes are refused
    local, said = tmp_path / "staged", []
    uploader = Uploader(local, remote, keep=1, report=said.append).start()
    for step in (1, 2, 3):
        assert not told(uploader, save(local, step, b"%d" % step)).waiting
    assert [line for line in said if "could not delete" in line] == [
        f"could not delete {remote.url}/checkpoints/step-000000001.pt (403 access denied: "
        "Access Denied); the bucket keeps it until a delete works again (tried after each "
        "save)"]
    remote.allow = True
    told(uploader, save(local, 4, b"4"))
    assert sorted(k for k in remote.sizes() if "step-" in k) == ["checkpoints/step-000000004.pt"]


def test_best_pt_reaches_the_bucket_where_the_file_system_has_no_hard_links(tmp_path,
                                                                           monkeypatch):
    """The real upload process and checkpoint folder, with os.link refused in the saving
    process: best.pt is a copy here, and the bucket's best.pt a copy of the step file it
    names there."""
    def no_hard_links(*_):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)
    local, bucket, said = tmp_path / "staged", tmp_path / "bucket", []
    local.mkdir()
    (bucket / "checkpoints").mkdir(parents=True)  # a folder as the bucket: one has no folders
    remote = RemoteRunFolder(DatasetRoot("run", str(bucket)))
    upload = UploadProcess(local, remote, keep=2, report=said.append)
    folder = CheckpointFolder(local / "checkpoints", keep=2, announce=upload.uploads.saved)
    best = folder.save({"weights": torch.arange(3)}, step=1, best=True)
    folder.save({"weights": torch.arange(4)}, step=2)
    mirrored = upload.finish(60)
    assert not mirrored.waiting and mirrored.newest_named, said
    assert os.stat(local / "checkpoints" / "best.pt").st_nlink == 1  # a copy, not a link
    checkpoints = bucket / "checkpoints"
    assert (checkpoints / "best.pt").read_bytes() == best.read_bytes()
    assert (checkpoints / "last.pt").read_bytes() == (checkpoints / "step-000000002.pt"
                                                      ).read_bytes()


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

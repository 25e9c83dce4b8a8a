"""Datasets from an archive URL (app/catalog/archive.py, fetcher.py): downloaded from a real
HTTP server on loopback (tests/file_server.py), verified, unpacked into the cache on first use
and opened as an ImageFolder; every failure one line, and nothing half-made left behind.

The archives hold small JPEGs cut from matplotlib's photo of Grace Hopper: 3 classes, 4 train
and 2 val images each, about 20 KB in all."""

from __future__ import annotations

import hashlib
import io
import random
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from matplotlib import cbook
from PIL import Image, ImageOps
from tqdm import tqdm

import app
from app.catalog import Catalog, archive, fetcher
from app.catalog.tables import load_tables
from app.runtime.errors import UserError
from conftest import REPO, TINY_TRAIN_FLAGS, run_driver, write_catalog
from file_server import FileServer
from s3 import free_port
from trained import epoch_records

CLASSES = ["n01440764", "n02102040", "n02979186"]  # imagenette's first three wnids
TRAIN_PER_CLASS, VAL_PER_CLASS = 4, 2


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    """ImageFolder files: a different crop of the photo per class, shifted and flipped per
    image, 40 px."""
    photo = Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    files = {}
    for label, wnid in enumerate(CLASSES):
        for n in range(TRAIN_PER_CLASS + VAL_PER_CLASS):
            left, top = 120 * label + 15 * n, 90 * label + 10 * n
            image = photo.crop((left, top, left + 240, top + 240)).resize((40, 40))
            image = ImageOps.mirror(image) if n % 2 else image
            data = io.BytesIO()
            image.save(data, "JPEG", quality=85)
            split = "train" if n < TRAIN_PER_CLASS else "val"
            files[f"{split}/{wnid}/{wnid}_{n}.JPEG"] = data.getvalue()
    return files


def write_archive(path: Path, files: dict[str, bytes], top: str = "") -> None:
    """`files` in a .tar, .tgz/.tar.gz or .zip, under the folder `top` when given."""
    names = {f"{top}/{name}" if top else name: data for name, data in files.items()}
    if path.suffix == ".zip":
        with zipfile.ZipFile(path, "w") as zipped:
            for name, data in names.items():
                zipped.writestr(name, data)
        return
    with tarfile.open(path, "w" if path.suffix == ".tar" else "w:gz") as tar:
        for name, data in names.items():
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(data), 0o644
            tar.addfile(member, io.BytesIO(data))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    served = FileServer(folder, folder.parent / "requests.jsonl")
    yield served
    served.stop()


def digests(path: Path) -> dict[str, str]:
    return {"md5": hashlib.md5(path.read_bytes()).hexdigest(),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def served_archive(server, name: str, files: dict[str, bytes], top: str = "") -> dict[str, str]:
    """The archive `name` on the server: its file's digests."""
    path = server.folder / name
    write_archive(path, files, top)
    return digests(path)


def catalog_of(tmp_path: Path, url: str, **keys) -> Catalog:
    """A catalog whose entry `net` is the archive at `url`, cached below tmp_path/cache."""
    entry = {"url": url, "layout": "imagefolder", "cache_dir": str(tmp_path / "cache"), **keys}
    return Catalog.load(write_catalog(tmp_path / "datasets.toml", {"net": entry}))


def sizeof(count: int) -> str:
    """A size as the progress bar and the messages write it."""
    return tqdm.format_sizeof(count, "B", 1024)


def body_gets(server, name: str) -> list[dict]:
    return [r for r in server.requests() if r["path"] == f"/{name}" and r["method"] == "GET"]


def cache_files(tmp_path: Path) -> list[str]:
    """What the archive cache's folders (one per URL) hold besides lock files."""
    return sorted(p.name for p in (tmp_path / "cache" / "archives").glob("*/*")
                  if p.suffix != ".lock")


def fetched_path(tmp_path: Path, url: str) -> Path:
    """Where the fetcher puts the archive at `url` for the entries of `catalog_of`."""
    return fetcher.cached_path(url, "archives", tmp_path / "cache")


def assert_opened_whole(root, photos) -> None:
    tables = load_tables(root)
    assert tables.wnids == CLASSES
    assert tables.train.groupby("label").size().tolist() == [TRAIN_PER_CLASS] * 3
    assert tables.val.groupby("label").size().tolist() == [VAL_PER_CLASS] * 3
    assert (tables.train.path.str.split("/").str[1].map(CLASSES.index)
            == tables.train.label).all()
    assert all((Path(root.url) / name).read_bytes() == data for name, data in photos.items())


def test_first_use_downloads_verifies_unpacks_and_later_runs_make_no_request(
        server, photos, tmp_path):
    files = {**photos, "noisy_imagenette.csv": b"path,noisy_labels_1\n"}
    checksums = served_archive(server, "first.tgz", files, top="imagenette2-320")
    catalog = catalog_of(tmp_path, server.url("first.tgz"), md5=checksums["md5"])
    lines: list[str] = []
    root = catalog.open("net", report=lines.append)
    folder = fetched_path(tmp_path, server.url("first.tgz")).with_name(
        f"first-{checksums['md5'][:8]}")
    assert root.url == str(folder) and root.layout == "imagefolder"
    size = sizeof((server.folder / "first.tgz").stat().st_size)
    assert lines == [f"downloading {server.url('first.tgz')} ({size}) into {folder.parent} "
                     "(first use only)", f"unpacking first.tgz into {folder}"]
    assert_opened_whole(root, photos)
    assert (folder / "noisy_imagenette.csv").is_file()  # what sits beside the splits stays
    assert cache_files(tmp_path) == [folder.name]  # no .part, no staging folder
    requests = len(server.requests())
    again = catalog_of(tmp_path, server.url("first.tgz"), md5=checksums["md5"])
    assert again.open("net", report=lines.append).url == str(folder)
    assert len(server.requests()) == requests and len(lines) == 2  # downloading, unpacking


@pytest.mark.parametrize("name, top, checksum", [
    ("root.tar", "", "sha256"),
    ("top.zip", "imagenette2-160", "sha256"),
    ("root.tar.gz", "", "md5"),
])
def test_tar_zip_and_gzip_with_either_checksum_and_either_shape(
        server, photos, tmp_path, name, top, checksum):
    checksums = served_archive(server, name, photos, top)
    root = catalog_of(tmp_path, server.url(name), **{checksum: checksums[checksum]}).open("net")
    assert_opened_whole(root, photos)
    assert Path(root.url).name == f"{name.split('.')[0]}-{checksums[checksum][:8]}"


def test_a_local_archive_is_read_through_the_same_path(photos, tmp_path):
    write_archive(tmp_path / "mine.zip", photos, top="mine")
    catalog = catalog_of(tmp_path, "mine.zip", sha256=digests(tmp_path / "mine.zip")["sha256"])
    assert_opened_whole(catalog.open("net"), photos)  # relative to the catalog file
    assert (tmp_path / "mine.zip").is_file()  # the user's own file is left alone


def test_a_wrong_checksum_removes_the_download_and_the_next_run_downloads_again(
        server, photos, tmp_path):
    checksums = served_archive(server, "wrong.tgz", photos)
    with pytest.raises(UserError) as error:
        catalog_of(tmp_path, server.url("wrong.tgz"), sha256="0" * 64).open("net")
    assert str(error.value) == (
        f"{server.url('wrong.tgz')} has sha256 {checksums['sha256']}, but the catalog expects "
        f"{'0' * 64}; removed the download (the next run downloads it again); if the file "
        f"changed at its source, update `sha256` of [datasets.net] in {tmp_path}/datasets.toml")
    assert cache_files(tmp_path) == []
    fixed = catalog_of(tmp_path, server.url("wrong.tgz"), sha256=checksums["sha256"])
    assert_opened_whole(fixed.open("net"), photos)
    assert [r["range"] for r in body_gets(server, "wrong.tgz")] == [None, None]


# Cut downloads carry 2 MB that do not compress: the client's reads then pause while the
# server's first half is still in flight (aiohttp buffers at most 128 KB), so some of it is
# written before the client sees the connection close (it drops what it has buffered then).
NOISE = {"noise.bin": random.Random(0).randbytes(2 << 20)}


def test_a_cut_download_is_continued_with_a_range_request(server, photos, tmp_path):
    checksums = served_archive(server, "cut.tgz", {**photos, **NOISE})
    size = (server.folder / "cut.tgz").stat().st_size
    catalog = catalog_of(tmp_path, server.url("cut.tgz?cut=1"), md5=checksums["md5"])
    with pytest.raises(UserError) as error:
        catalog.open("net")
    part = fetcher.hidden(fetched_path(tmp_path, server.url("cut.tgz?cut=1")), "part")
    kept = part.stat().st_size
    assert 0 < kept <= size // 2
    assert str(error.value).startswith(
        f"the download of {server.url('cut.tgz?cut=1')} stopped at {sizeof(kept)} of "
        f"{sizeof(size)} (ClientPayloadError: Response payload is not completed")
    assert str(error.value).endswith(
        f"run again to continue it from {part} (where the server honours Range requests; from "
        "the start where it does not)")
    lines: list[str] = []
    assert_opened_whole(catalog.open("net", report=lines.append), photos)
    assert lines[0] == (f"continuing the download of {server.url('cut.tgz?cut=1')} at "
                        f"{sizeof(kept)} of {sizeof(size)} into {part.parent} (first use only)")
    first, second = body_gets(server, "cut.tgz")
    assert (first["range"], first["bytes"]) == (None, size // 2)
    assert (second["range"], second["status"]) == (f"bytes={kept}-{size - 1}", 206)
    assert second["bytes"] == size - kept  # only the rest travelled
    assert cache_files(tmp_path) == [f"cut-{checksums['md5'][:8]}"]


def test_a_cut_download_starts_again_where_the_server_ignores_ranges(server, photos, tmp_path):
    checksums = served_archive(server, "again.tgz", {**photos, **NOISE})
    size = (server.folder / "again.tgz").stat().st_size
    catalog = catalog_of(tmp_path, server.url("again.tgz?cut=1&ranges=ignore"),
                         md5=checksums["md5"])
    with pytest.raises(UserError, match="stopped at"):
        catalog.open("net")
    lines: list[str] = []
    assert_opened_whole(catalog.open("net", report=lines.append), photos)
    assert any("ignores Range requests); downloading it again from the start" in line
               for line in lines)
    statuses = [(r["range"] is not None, r["status"]) for r in body_gets(server, "again.tgz")]
    assert statuses == [(False, 200), (True, 200), (False, 200)]  # cut, ignored, whole
    assert body_gets(server, "again.tgz")[-1]["bytes"] == size


def test_404_names_the_url_and_the_key_to_check(server, tmp_path):
    catalog = catalog_of(tmp_path, server.url("absent.tgz"), md5="0" * 32)
    with pytest.raises(UserError) as error:
        catalog.open("net")
    assert str(error.value) == (f"{server.url('absent.tgz')} not found (HTTP 404); check `url` "
                                f"of [datasets.net] in {tmp_path}/datasets.toml")


def test_a_refused_connection_says_to_check_the_network_or_download_it_yourself(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/imagenette2-320.tgz"  # nobody listens there
    with pytest.raises(UserError) as error:
        catalog_of(tmp_path, url, md5="0" * 32).open("net")
    message = str(error.value)
    assert message.startswith(f"cannot download {url} (ClientConnectorError: Cannot connect")
    assert message.endswith("check the network or the proxy (HTTPS_PROXY), or download the "
                            "file yourself and set `url` of [datasets.net] in "
                            f"{tmp_path}/datasets.toml to its local path")
    assert "\n" not in message and cache_files(tmp_path) == []


def test_an_archive_of_another_layout_names_what_it_holds(server, photos, tmp_path):
    files = {f"images/{name}": data for name, data in photos.items()}
    checksums = served_archive(server, "other.tar", {**files, "labels.csv": b"a,b\n"})
    with pytest.raises(UserError) as error:
        catalog_of(tmp_path, server.url("other.tar"), md5=checksums["md5"]).open("net")
    assert str(error.value).startswith(
        f"archive {server.url('other.tar')} holds images/, labels.csv at its top, not train/ "
        "and val/ with class folders (at its root or under one top folder); point `url` of")
    assert cache_files(tmp_path) == []  # no staging folder, no archive kept


def test_a_member_that_would_land_outside_is_refused(tmp_path, photos):
    path = tmp_path / "evil.tar"
    write_archive(path, {**photos, "../escaped.txt": b"outside"})
    with pytest.raises(UserError, match=r"evil.tar holds a member that would land outside its "
                                        r"folder \(.*escaped.txt.*\); it is not unpacked"):
        catalog_of(tmp_path, str(path), md5=digests(path)["md5"]).open("net")
    assert not list(tmp_path.rglob("escaped.txt")) and cache_files(tmp_path) == []


# Opens the entry in a process of its own, the way a run does; with a third argument its files
# may grow to that many bytes (RLIMIT_FSIZE: writes past it fail with EFBIG, a full disk's kin).
OPEN_IN_A_PROCESS = """
import resource, signal, sys
from app.catalog import Catalog
from app.catalog.tables import load_tables
from app.runtime.errors import UserError
catalog = Catalog.load(sys.argv[1])
if len(sys.argv) > 3:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), hard))
try:
    root = catalog.open(sys.argv[2], report=lambda line: print(line, flush=True))
except UserError as error:
    print(f"error: {error}", flush=True)
    sys.exit(2)
print("opened", root.url, len(load_tables(root).train), flush=True)
"""


def open_in_a_process(catalog: Catalog, *limit: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", OPEN_IN_A_PROCESS, str(catalog.path), "net",
                             *limit], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.parametrize("stage, limit", [("download", 8_000), ("unpack", 200_000)])
def test_a_full_disk_leaves_nothing_half_made_and_says_what_is_needed(
        server, photos, tmp_path, stage, limit):
    """The archive (~20 KB) is too large for the limit, or its 400 KB csv is."""
    name = f"full-{stage}.tgz"
    checksums = served_archive(server, name, {**photos, "noisy.csv": b"a,b\n" * 100_000})
    catalog = catalog_of(tmp_path, server.url(name), md5=checksums["md5"])
    process = open_in_a_process(catalog, str(limit))
    out, err = process.communicate(timeout=60)
    *reported, line = out.splitlines()
    assert process.returncode == 2 and "Traceback" not in err
    assert len(reported) == (2 if stage == "unpack" else 1)  # downloading (, unpacking)
    unpacked = sum(len(data) for data in photos.values()) + 400_000
    taken = sizeof((server.folder / name).stat().st_size)
    needs = f"the archive takes {taken} and unpacks to {sizeof(unpacked)}" \
        if stage == "unpack" else f"the file takes {taken}"
    assert line == (f"error: no room left in {fetched_path(tmp_path, server.url(name)).parent} "
                    f"for {server.url(name)} (File too large): "
                    f"{needs}; free space there, or set IMAGENET_DP_CACHE or `cache_dir` of "
                    f"[datasets.net] in {tmp_path}/datasets.toml to a folder with room")
    assert cache_files(tmp_path) == []  # no part, no half-unpacked folder


def test_processes_asking_at_once_download_once(server, photos, tmp_path):
    """The test holds the archive's lock while two processes start, so both must wait for it
    (no timing luck); then one downloads and the other finds the folder made."""
    checksums = served_archive(server, "once.tgz", photos)
    catalog = catalog_of(tmp_path, server.url("once.tgz"), md5=checksums["md5"])
    source = archive.Archive(server.url("once.tgz"), "md5", checksums["md5"], "")
    folder = archive.cache_folder(source, tmp_path / "cache")
    folder.parent.mkdir(parents=True)
    with fetcher.machine_lock(folder):
        processes = [open_in_a_process(catalog) for _ in range(2)]
        for process in processes:  # each says once that it waits
            assert process.stdout.readline().startswith(
                f"waiting for another process that downloads {server.url('once.tgz')} into "
                f"{folder} (at most 30 min)")
    results = [process.communicate(timeout=60) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], results
    assert sorted(out.splitlines()[-1] for out, _ in results) == \
        [f"opened {folder} {TRAIN_PER_CLASS * 3}"] * 2
    assert not any("waiting" in out for out, _ in results)  # said once, not again
    assert len(body_gets(server, "once.tgz")) == 1


def test_a_wait_for_another_download_is_bounded(server, tmp_path, monkeypatch):
    catalog = catalog_of(tmp_path, server.url("held.tgz"), md5="0" * 32)
    folder = archive.cache_folder(archive.Archive(server.url("held.tgz"), "md5", "0" * 32, ""),
                                  tmp_path / "cache")
    folder.parent.mkdir(parents=True)
    monkeypatch.setattr(fetcher, "LOCK_WAIT_S", 0.3)
    lines: list[str] = []
    with fetcher.machine_lock(folder), pytest.raises(UserError) as error:
        catalog.open("net", report=lines.append)
    assert lines == [f"waiting for another process that downloads {server.url('held.tgz')} "
                     f"into {folder} (at most 0 s)"]
    assert str(error.value) == (f"waited 0 s for another process to download "
                                f"{server.url('held.tgz')} into {folder}; stop it if it hangs "
                                f"(the process that holds {fetcher.hidden(folder, 'lock')}), "
                                "then run again")


def test_an_archive_in_a_bucket(s3_server, photos, tmp_path):
    (tmp_path / "bucket").mkdir()
    write_archive(tmp_path / "bucket" / "net.tgz", photos, top="net")
    s3_server.upload(tmp_path / "bucket", "archives", "fastai")
    catalog = catalog_of(tmp_path, "s3://archives/fastai/net.tgz", endpoint_url=s3_server.endpoint,
                         sha256=digests(tmp_path / "bucket" / "net.tgz")["sha256"])
    assert_opened_whole(catalog.open("net"), photos)


@pytest.mark.parametrize("entry, message", [
    ({"url": "x.tgz", "layout": "imagefolder"}, "`url` names an archive; add its checksum, "
                                                'sha256 = "..."'),
    ({"url": "x.zip", "layout": "imagefolder", "md5": "0" * 32, "sha256": "0" * 64},
     "give one checksum, `sha256` or `md5`, not both"),
    ({"url": "x.tar", "layout": "imagefolder", "md5": "abc"},
     "`md5` must be 32 hexadecimal digits, got 'abc'"),
    ({"url": "x.tgz", "md5": "0" * 32}, 'read in the ImageFolder layout (train/<wnid>/, '
                                       'val/<wnid>/); set layout = "imagefolder"'),
    ({"url": "/data/imagenet", "sha256": "0" * 64}, "`sha256` verifies a downloaded archive, "
                                                    "but `url` names none"),
])
def test_archive_entries_are_checked_when_the_catalog_loads(tmp_path, entry, message):
    with pytest.raises(UserError) as error:
        Catalog.load(write_catalog(tmp_path / "c.toml", {"bad": entry}))
    assert message in str(error.value) and "[datasets.bad]" in str(error.value)


def test_the_default_catalog_names_the_fast_ai_archives():
    entries = Catalog.load(REPO / "datasets.toml").entries
    assert entries["imagenette"]["md5"] == "3df6f0d01a2c9592104656642f5e78a3"
    assert entries["imagewoof"]["url"].endswith("/imagewoof2-320.tgz")
    assert len(entries["imagewoof"]["sha256"]) == 64
    assert entries["imagenette_local"]["url_env"] == "IMAGENETTE_ROOT"
    assert {entries[name]["layout"] for name in
            ("imagenette", "imagewoof", "imagenette_local")} == {"imagefolder"}


def test_the_driver_trains_on_an_archive_and_fails_in_one_line_without_it(
        server, photos, tmp_path):
    checksums = served_archive(server, "driver.tgz", photos, top="driver")
    catalog = write_catalog(tmp_path / "datasets.toml", {
        "net": {"url": server.url("driver.tgz"), "md5": checksums["md5"],
                "layout": "imagefolder"},
        "gone": {"url": server.url("gone.tgz"), "md5": checksums["md5"],
                 "layout": "imagefolder"}})
    flags = ["--catalog", str(catalog), *TINY_TRAIN_FLAGS, "-b", "4", "--epochs", "1",
             "--devices", "cpu"]
    env = {"IMAGENET_DP_CACHE": str(tmp_path / "cache")}
    failed = run_driver(*flags, "--dataset", "gone", cwd=tmp_path, env=env)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1] == (
        f"error: {server.url('gone.tgz')} not found (HTTP 404); check `url` of "
        f"[datasets.gone] in {catalog}")
    trained = run_driver(*flags, "--dataset", "net", "--run-name", "net", cwd=tmp_path, env=env)
    assert trained.returncode == 0, trained.stderr
    folder = fetched_path(tmp_path, server.url("driver.tgz")).with_name(
        f"driver-{checksums['md5'][:8]}")
    assert f"unpacking driver.tgz into {folder}" in trained.stderr
    assert "3 classes, 12 train / 6 val images" in trained.stderr  # the archive's photos
    assert len(epoch_records(tmp_path / "runs" / "net")) == 1


def test_the_python_face_opens_an_archive_entry_as_the_driver_does(server, photos, tmp_path):
    """app.open_catalog(...).dataset(NAME): the same download on first use, then the splits of
    what it unpacked, class by class."""
    checksums = served_archive(server, "face.tgz", photos, top="face")
    catalog = catalog_of(tmp_path, server.url("face.tgz"), md5=checksums["md5"])
    data = app.open_catalog(catalog.path).dataset("net")
    train, val = data.split("train"), data.split("val")
    expected = {split: sorted(name for name in photos if name.startswith(f"{split}/"))
                for split in ("train", "val")}
    assert sorted(train.frame.path) == expected["train"]
    assert sorted(val.frame.path) == expected["val"]
    assert train.num_classes == len({name.split("/")[1] for name in photos})

"""Shards: the wds and parquet layouts from foreign copies (tests/shard_copies.py writes them as
Hugging Face lays them out, with tarfile and pyarrow), the windowed order, training from them
locally and on the loopback S3 server with 2 workers in both sync modes, exact resume after
SIGTERM with both decoders, bad samples and damaged shards."""

import io
import json
import re
import shutil
import tarfile
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from app.catalog.dataset import Dataset
from app.catalog.retry import ATTEMPTS
from app.catalog.shard_index import ShardError, index_tar
from app.catalog.shard_writer import main as make_shards
from app.catalog.shards import load_tables as shard_tables
from app.catalog.storage import DatasetRoot
from app.catalog.tables import load_tables
from app.config.sources import parse_config
from app.data.shard_reader import ShardSamples
from app.data.windows import WindowedBatches
from app.launch.run import prepare_job
from app.runtime.errors import UserError
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE
from app.training import preflight
from conftest import run_driver, skipped_rows, write_catalog
from s3 import FaultyProxy
from shard_copies import PARQUET_SCHEMA, rows, write_parquet, write_wds
from exact_runs import assert_bit_identical, last, stop_with_sigterm_after

CORRUPT = 85  # the 86th train sample in the copies' order: sample 5 of train shard 1
# all 10 classes: 320 images, global batch 32 (SPLITS): 10 steps
ONE_EPOCH = ("-a", "test_resnet", "--image-size", "32", "-j", "0", "--lr", "0.2",
             "--warmup-epochs", "0.5", "--epochs", "1", "-p", "1")
SPLITS = {"ps": ("-b", "16", "--devices", "cpu,cpu", "--sync", "ps"),
          "allreduce": ("-b", "16", "--devices", "cpu,cpu", "--sync", "allreduce"),
          "1 worker": ("-b", "32")}


@pytest.fixture(scope="module")
def copies(tmp_path_factory, tiny_sample):
    """The tiny sample as timm's wds copy (with a sample that is not an image) and as
    imagenet-1k's parquet copy: the same samples in the same shards, in the same order."""
    folder = tmp_path_factory.mktemp("shards")
    return {"wds": write_wds(tiny_sample, folder / "wds", corrupt=CORRUPT),
            "parquet": write_parquet(tiny_sample, folder / "parquet", corrupt=CORRUPT)}


def entry(url, layout, **options):
    return {"url": str(url), "layout": layout, "window": 2, **options}


def test_both_layouts_list_the_source_samples_with_imagenet_classes(copies, tiny_sample,
                                                                    tmp_path):
    source = load_tables(DatasetRoot("source", str(tiny_sample)))
    expected = sorted(label for part in rows(tiny_sample, "train", 4) for _, _, label in part)
    for layout, folder in copies.items():
        tables = shard_tables(DatasetRoot(layout, str(folder), layout=layout))
        assert tables.num_classes == 1000 and tables.descriptions[1].startswith("goldfish")
        assert len(tables.train) == len(source.train) and len(tables.val) == len(source.val)
        assert tables.train.path[85].endswith("-0001.tar#5" if layout == "wds"
                                              else "train-00001-of-00004.parquet#5")
        assert list(np.bincount(tables.train.shard)) == [80, 80, 80, 80]
        if layout == "parquet":  # the labels are read ahead; wds's come with the samples
            assert sorted(tables.train.label) == expected
    # --classes: samples of other classes are passed over using the shards' class indices
    # (the wds copy without _info.json: its tars are scanned once, as for counting)
    bare = write_wds(tiny_sample, tmp_path / "bare", info=False)
    for root in (DatasetRoot("wds", str(bare), layout="wds"),
                 DatasetRoot("parquet", str(copies["parquet"]), layout="parquet")):
        subset = shard_tables(root, 3)
        assert subset.wnids == source.wnids[:3] and len(subset.train) == 96
        assert set(subset.train.label) == {0, 1, 2} and len(subset.val) == 30


def test_the_python_api_reads_a_shard_layout_as_the_driver_does(copies):
    """app.open_catalog(...).dataset(name).split(...): the same samples and classes."""
    for layout, folder in copies.items():
        root = DatasetRoot(layout, str(folder), layout=layout)
        data = Dataset(root)
        for name in ("train", "val"):
            split = data.split(name, classes=range(3))
            expected = getattr(shard_tables(root, 3), name)
            assert split.num_classes == 3 and split.classes.wnids == shard_tables(root, 3).wnids
            assert list(split.frame.path) == list(expected.path)


def test_the_windowed_order_is_a_function_of_seed_and_epoch_split_among_ranks():
    shards = np.repeat(np.arange(7), [5, 9, 0, 6, 8, 7, 5])  # a shard with no samples left
    one = WindowedBatches(shards, 12, window=3, seed=4)
    order = one.order(2)
    assert sorted(order) == list(range(len(shards)))  # every sample once
    start = 0
    for window in one.windows(2):  # a window's samples come together, from its shards only
        size = int(sum(np.bincount(shards, minlength=7)[window]))
        assert set(shards[order[start:start + size]]) <= set(window)
        start += size
    assert not np.array_equal(order, one.order(3)) and np.array_equal(order, one.order(2))
    halves = [WindowedBatches(shards, 6, window=3, seed=4, rank=r, world_size=2) for r in (0, 1)]
    for step in range(one.steps_per_epoch()):  # 2 workers x 6 == 1 worker x 12
        assert one.items(order, 2, step) == [item for half in halves
                                             for item in half.items(half.order(2), 2, step)]


def test_damaged_parquet_shards_name_the_shard_and_where(copies, tmp_path):
    folder = shutil.copytree(copies["parquet"], tmp_path / "copy")
    shard = folder / "data" / "train-00002-of-00004.parquet"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    with pytest.raises(ShardError, match=rf"train-00002-of-00004.parquet is truncated .* byte "
                                         rf"offset {len(data) // 2}"):
        shard_tables(DatasetRoot("copy", str(folder), layout="parquet"))


def test_train_from_s3_with_2_workers_in_few_requests_and_list_the_corrupt_sample(runs):
    """From the bucket, wds under ps and parquet under allreduce (local copies train in the
    resume tests below, ending identical to these runs): a shard is fetched once for the
    machine, whichever rank asks first, and samples are read from there."""
    run, _ = runs
    requests = {}
    for dataset, sync in (("wds-s3", "ps"), ("parquet-s3", "allreduce")):
        done = run(dataset, "pillow", sync)
        requests[dataset] = done.requests
        assert "320 train / 100 val images" in done.stderr
        (row,) = skipped_rows(done.folder)
        assert row["path"].endswith("0001.tar#5" if dataset == "wds-s3"
                                    else "train-00001-of-00004.parquet#5")
        assert row["reason"].startswith("not decodable"), row
    # 420 samples each; a per-image layout makes 420 GETs. Here: a GET per shard (6), the
    # parquet files' footers and labels, and the catalog's lists and lookups.
    assert requests["wds-s3"] <= 6 + 12 and requests["parquet-s3"] <= 6 * 4 + 12, requests


def damage(folder: Path, how: str) -> tuple[Path, str]:
    """A train shard of the copy in `folder` cut short, damaged inside or removed: the shard,
    and what the error line says after its name."""
    if how == "truncated":  # a tar cut inside a member
        shard = folder / "imagenet1k-train-0003.tar"
        shard.write_bytes(shard.read_bytes()[:40_000])
        return shard, r" is truncated: .*byte offset.*\b40000\b"
    if how == "missing":  # listed in _info.json: a partial download
        shard = folder / "imagenet1k-train-0003.tar"
        shard.unlink()
        return shard, r" is missing; put it back"
    # parquet: its footer and labels intact, the page header of row group 1's images garbled
    shard = folder / "data" / "train-00003-of-00004.parquet"
    chunk = pq.ParquetFile(shard).metadata.row_group(1).column(0)
    with open(shard, "r+b") as handle:
        handle.seek(chunk.data_page_offset)
        handle.write(b"\xff" * 32)
    return shard, r": row group 1 of 2 is unreadable \(.*\); download or write it again"


@pytest.mark.parametrize("layout, decoder, how", [
    ("wds", "pillow", "truncated"), ("wds", "dali", "truncated"),
    ("parquet", "pillow", "damaged"), ("wds", "pillow", "missing")])
def test_a_truncated_damaged_or_missing_shard_ends_the_run_with_one_line(
        copies, tmp_path, layout, decoder, how):
    folder = shutil.copytree(copies[layout], tmp_path / "copy")
    shard, says = damage(folder, how)
    catalog = write_catalog(tmp_path / "datasets.toml", {"copy": entry(folder, layout)})
    result = run_driver("--catalog", str(catalog), "-a", "test_resnet", "--image-size", "32",
                        "-b", "32", "-j", "1", "--epochs", "1", "--decoder", decoder,
                        cwd=tmp_path)  # the error is met in a loader (or DALI reader) process
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert re.match(rf"error: (dataset 'copy': )?shard {re.escape(str(shard))}{says}",
                    message), message


def test_shards_missing_from_a_bucket_are_named_before_training(copies, tmp_path, s3_server):
    """A partial copy (_info.json lists shards that are not there): every shard is checked,
    with a listing, not sampled; none may be skipped (every later sample would move)."""
    files = sorted(str(p.relative_to(copies["wds"])) for p in copies["wds"].iterdir())
    gone = ["imagenet1k-train-0001.tar", "imagenet1k-validation-0000.tar"]
    url = s3_server.upload(copies["wds"], "shards-partial", "wds",
                           only=[name for name in files if name not in gone])
    catalog = write_catalog(tmp_path / "datasets.toml", {"wds": entry(
        url, "wds", endpoint_url=s3_server.endpoint)})
    config, _ = parse_config(["--catalog", str(catalog), "--output-dir", str(tmp_path / "runs"),
                              "--max-bad-fraction", "0.5"])
    with pytest.raises(UserError, match=rf"^dataset 'wds': shard {url}/{gone[0]} is missing "
                                        r"\(and 1 more\); put it back"):
        preflight.check(prepare_job(config), saves=False)


def test_a_shard_that_vanishes_from_the_bucket_mid_run_is_tried_again_then_named(
        copies, tmp_path, s3_server):
    """Gone after the run listed and checked its shards (a lifecycle rule, a bucket being
    re-synced): the proxy answers its reads 404, as S3 does once an object is deleted, while
    listings still name it. Its fetch is tried again like a GET, then the run ends with one
    line naming it, and the checkpoints written before stand. (Deleting the object while the
    run trains would race the fetch of the window ahead.)"""
    url = s3_server.upload(copies["wds"], "shards-vanishing", "wds")
    frame = shard_tables(DatasetRoot("wds", str(copies["wds"]), layout="wds")).train
    (second,) = WindowedBatches(frame.shard.to_numpy(), 64, window=1).windows(0)[1]
    name = f"imagenet1k-train-{second:04d}.tar"  # its first sample in step 2 of 5
    proxy = FaultyProxy(s3_server.endpoint, missing=(f"shards-vanishing/wds/{name}",))
    catalog = write_catalog(tmp_path / "datasets.toml", {"wds": entry(
        url, "wds", window=1, endpoint_url=proxy.endpoint, cache_dir=str(tmp_path / "cache"))})
    try:
        result = run_driver("--catalog", str(catalog), "-a", "test_resnet", "--image-size",
                            "32", "-b", "64", "-j", "0", "--epochs", "1",
                            "--checkpoint-interval", "0.0001", "--run-name", "cut", cwd=tmp_path)
        tries = proxy.counts["missing"]
    finally:
        proxy.stop()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(
        f"error: shard {url}/{name} is missing after {ATTEMPTS} attempts ("), message
    assert message.endswith("resume with --resume auto (the last checkpoint stands)"), message
    assert tries >= ATTEMPTS  # the read that reports it tried them all (the fetch ahead may too)
    cut = last(tmp_path / "runs" / "cut")
    assert (cut["epoch"], cut["epoch_step"]) == (0, 1)


class Run(NamedTuple):
    checkpoint: dict  # the last one
    folder: Path
    stderr: str
    requests: int  # of the bucket


@pytest.fixture(scope="module")
def runs(copies, s3_server, tmp_path_factory):
    """run(dataset, decoder, split): an uninterrupted one-epoch run (SPLITS), made once.
    Datasets: the copies as folders (`wds`, `parquet`) and in a bucket behind a proxy that
    counts the requests (`wds-s3`, `parquet-s3`). They hold the same samples in the same shards
    and order, so runs from any of them with the same flags must end identical."""
    cwd = tmp_path_factory.mktemp("straight")
    proxy = FaultyProxy(s3_server.endpoint)
    s3 = {"endpoint_url": proxy.endpoint, "cache_dir": str(cwd / "cache")}
    catalog = write_catalog(cwd / "datasets.toml", {
        **{layout: entry(folder, layout) for layout, folder in copies.items()},
        **{f"{layout}-s3": entry(s3_server.upload(folder, "shards", layout), layout, **s3)
           for layout, folder in copies.items()}})
    made = {}

    def run(dataset: str, decoder: str, split: str) -> Run:
        if (dataset, decoder, split) not in made:
            name, before = f"{dataset}-{decoder}-{len(made)}", proxy.counts["requests"]
            result = run_driver("--catalog", str(catalog), "--dataset", dataset, *ONE_EPOCH,
                                *SPLITS[split], "--decoder", decoder, "--run-name", name,
                                cwd=cwd)
            assert result.returncode == 0, result.stderr
            made[dataset, decoder, split] = Run(last(cwd / "runs" / name),
                                                cwd / "runs" / name, result.stderr,
                                                proxy.counts["requests"] - before)
        return made[dataset, decoder, split]
    yield run, catalog
    proxy.stop()


# Stopped and resumed from local copies, ending as a straight run of the same decoder and
# split: (wds, Pillow) under ps and (parquet, Pillow) under allreduce as the S3 test's runs, so
# both sync modes train locally and on S3; (parquet, DALI) as a local wds run, with one worker
# (DALI's pipelines cost the most to build on 2 cores).
@pytest.mark.parametrize("dataset, decoder, split, reference", [
    ("wds", "pillow", "ps", "wds-s3"), ("parquet", "pillow", "allreduce", "parquet-s3"),
    ("parquet", "dali", "1 worker", "wds")])
def test_sigterm_mid_epoch_then_resume_ends_bit_identical_to_a_straight_run(
        runs, tmp_path, dataset, decoder, split, reference):
    run, catalog = runs
    flags = ("--catalog", str(catalog), "--dataset", dataset, *ONE_EPOCH, *SPLITS[split],
             "--decoder", decoder, "--run-name", "cut")
    code, stderr = stop_with_sigterm_after(tmp_path, flags, step=3)  # of 10
    assert code == PREEMPTED_EXIT_CODE, stderr
    cut = last(tmp_path / "runs" / "cut")
    assert 0 < cut["epoch_step"] < 10 and cut["epoch"] == 0
    resumed = run_driver(*flags, "--resume", "auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert_bit_identical(run(reference, decoder, split).checkpoint,
                         last(tmp_path / "runs" / "cut"), end=(1, 10))


def test_the_shard_cache_keeps_its_bound_and_evicts_the_least_recently_used(
        tiny_sample, tmp_path, caplog):
    """W = 1 over 8 parquet shards (unpacked into the cache) and room for 4: read window after
    window, the cache holds the 4 most recently used shards, the previous, current and next
    windows among them, and never more than its bound. With W = 2 those 3 windows would not
    fit: the run is told at the start."""
    folder = write_parquet(tiny_sample, tmp_path / "copy", train_shards=8)
    files = sorted((folder / "data").glob("train-*.parquet"))
    sizes = sorted(sum(len(image["bytes"]) for image in pq.read_table(path)["image"].to_pylist())
                   for path in files)
    bound = sum(sizes[-4:])  # any 4 fit, no 5 do
    assert sum(sizes[:5]) > bound
    root = DatasetRoot("copy", str(folder), layout="parquet", options={
        "cache_dir": str(tmp_path / "cache"), "cache_max_gb": bound / 2**30, "window": 1})
    frame = shard_tables(root).train
    listed = preflight.listed_files(frame)
    for window, warned in ((1, False), (2, True)):
        caplog.clear()
        preflight.check_shards(replace(root, options={**root.options, "window": window}),
                               listed)
        assert ("raise `cache_max_gb` or lower `window`" in caplog.text) == warned, window
    batches = WindowedBatches(frame.shard.to_numpy(), 8, window=1)
    samples = ShardSamples(root, frame, batches)
    windows = [int(w[0]) for w in batches.windows(0)]
    for k, shard in enumerate(windows[:-1]):
        time.sleep(0.02)  # file times tick in jiffies: keep the windows' uses apart
        rows = batches.rows_of(np.array([shard]))[:3].tolist()
        assert [d for d, _, _ in samples.read(rows)] == [
            pq.read_table(files[shard])["image"].to_pylist()[n]["bytes"]
            for n in frame.path[rows].str.rsplit("#", n=1).str[1].astype(int)]
        samples._prefetch.join()  # noqa: SLF001 (the next window fetched, the cache trimmed)
        held = set(samples.store.data_files())  # the unpacked shards, nothing else
        assert held == {samples.store.data_path(f"data/{files[w].name}")
                        for w in windows[max(0, k - 2):k + 2]}, k
        assert sum(file.stat().st_size for file in held) <= bound


@pytest.fixture
def dotted_folders(tiny_imagefolder, tmp_path) -> Path:
    """The tiny sample in the ImageFolder layout with names such copies often have: dots in
    them, and the same names in every class folder (img.0.JPEG, img.1.JPEG, ... in each)."""
    folder = Path(shutil.copytree(tiny_imagefolder, tmp_path / "folders"))
    for class_folder in folder.glob("*/n*"):
        for number, image in enumerate(sorted(class_folder.iterdir())):
            image.rename(class_folder / f"img.{number}.JPEG")
    return folder


def test_make_shards_writes_what_the_layouts_and_other_readers_read_and_resumes(
        tiny_sample, dotted_folders, tmp_path):
    sources = {"tiny": DatasetRoot("tiny", str(tiny_sample)),
               "folders": DatasetRoot("folders", str(dotted_folders), layout="imagefolder")}
    catalog = write_catalog(tmp_path / "datasets.toml", {
        name: {"url": root.url, "layout": root.layout} for name, root in sources.items()})
    for dataset, root in sources.items():
        source = load_tables(root)
        by_path = {path: (Path(root.url) / path, label)  # every sample's own bytes and label
                   for frame in (source.train, source.val)
                   for path, label in zip(frame.path, frame.label)}
        for layout in ("wds", "parquet"):
            out = tmp_path / dataset / layout
            assert make_shards(["--catalog", str(catalog), "--dataset", dataset, "--format",
                                layout, str(out), "--shard-size", "60KB"]) == 0
            tables = shard_tables(DatasetRoot(layout, str(out), layout=layout))
            assert tables.wnids == source.wnids and tables.descriptions == source.descriptions
            assert (len(tables.train), len(tables.val)) == (len(source.train), len(source.val))
            assert tables.train.shard.max() >= 5  # several shards, classes mixed in each
            seen = []
            for shard in sorted(out.rglob("*.tar" if layout == "wds" else "*.parquet")):
                seen += (check_tar if layout == "wds" else check_parquet)(shard, by_path)
            assert sorted(seen) == sorted(by_path)  # every image once, its bytes as they were

    # A run killed part-way left some shards and a half-written one: started again, it keeps
    # the finished ones, removes the temporary file and adds the rest.
    out = tmp_path / "tiny" / "wds"
    tars = sorted(out.glob("imagenet1k-train-*.tar"))
    lost = {path: path.read_bytes() for path in tars[2:4]}
    for path in lost:
        path.unlink()
    (out / "_info.json").unlink()
    half = out / f".{tars[2].name}.4242.tmp"  # atomic_path's name for it
    half.write_bytes(lost[tars[2]][:5000])
    kept = {path: path.stat().st_mtime_ns for path in tars if path not in lost}
    assert make_shards(["--catalog", str(catalog), "--dataset", "tiny", "--format", "wds",
                        str(out), "--shard-size", "60KB"]) == 0
    assert all(path.stat().st_mtime_ns == mtime for path, mtime in kept.items())
    assert all(path.read_bytes() == data for path, data in lost.items())
    assert (out / "_info.json").is_file() and not half.exists()
    with pytest.raises(UserError, match="holds shards of another dataset or other arguments"):
        make_shards(["--catalog", str(catalog), "--dataset", "tiny", "--format", "wds",
                     str(out), "--shard-size", "1MB"])


def check_tar(path, by_path) -> list[str]:
    """Member by member: KEY.jpg (the source's bytes), KEY.cls (its label), KEY.json (its
    path); then as the layout indexes it (webdataset's key rule): each sample its own bytes
    and label."""
    names = []
    with tarfile.open(path) as tar:
        members = tar.getmembers()
        assert len(members) % 3 == 0
        for jpg, cls, meta in zip(members[::3], members[1::3], members[2::3]):
            key = jpg.name[:-len(".jpg")]
            assert "." not in key and key not in {name.split(".")[0] for name in names}
            assert (jpg.name, cls.name, meta.name) == (f"{key}.jpg", f"{key}.cls", f"{key}.json")
            info = json.loads(tar.extractfile(meta).read())
            file, label = by_path[info["path"]]
            assert tar.extractfile(jpg).read() == file.read_bytes()
            assert int(tar.extractfile(cls).read()) == label == info["label"]
            names.append(info["path"])
    index, data = index_tar(path, str(path)), path.read_bytes()
    assert len(index) == len(names)
    for name, offset, size, label in zip(names, index.offsets, index.sizes, index.labels):
        file, expected = by_path[name]
        assert data[offset:offset + size] == file.read_bytes() and label == expected
    return names


def check_parquet(path, by_path) -> list[str]:
    """Hugging Face's schema (and the features `datasets` decodes it with); the source's bytes."""
    schema = pq.read_schema(path)
    assert schema.remove_metadata() == PARQUET_SCHEMA
    features = json.loads(schema.metadata[b"huggingface"])["info"]["features"]
    assert features["image"] == {"_type": "Image"} and features["label"]["_type"] == "ClassLabel"
    names = []
    for row in pq.read_table(path).to_pylist():
        file, label = by_path[row["image"]["path"]]
        assert row["image"]["bytes"] == file.read_bytes() and row["label"] == label
        names.append(row["image"]["path"])
    return names


def test_make_shards_shorter_side_shrinks_larger_images_and_keeps_the_rest(tiny_sample,
                                                                          tmp_path):
    """--shorter-side 40: every image whose shorter side was above 40 px comes out at 40 px,
    in its own format, still decodable, with its aspect kept; smaller ones keep their bytes."""
    catalog = write_catalog(tmp_path / "datasets.toml", {"tiny": {"url": str(tiny_sample)}})
    out = tmp_path / "small"
    assert make_shards(["--catalog", str(catalog), "--dataset", "tiny", "--format", "wds",
                        str(out), "--shorter-side", "40"]) == 0
    source = load_tables(DatasetRoot("tiny", str(tiny_sample)))
    originals = {path: (tiny_sample / path).read_bytes()
                 for frame in (source.train, source.val) for path in frame.path}
    shrunk = kept = 0
    for shard in out.glob("*.tar"):
        with tarfile.open(shard) as tar:
            for jpg, _, meta in zip(*(iter(tar.getmembers()),) * 3):
                data = tar.extractfile(jpg).read()
                original = originals[json.loads(tar.extractfile(meta).read())["path"]]
                with Image.open(io.BytesIO(original)) as before, \
                        Image.open(io.BytesIO(data)) as after:
                    after.load()
                    assert after.format == before.format
                    if min(before.size) <= 40:
                        assert data == original
                        kept += 1
                    else:
                        assert min(after.size) == 40
                        ratio = before.size[0] / before.size[1]
                        assert abs(after.size[0] / after.size[1] - ratio) < 0.05
                        shrunk += 1
    assert shrunk > 0 and kept + shrunk == len(originals)

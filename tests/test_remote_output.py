"""--output-dir s3://...: the run folder staged locally and mirrored to a real S3 server on
loopback (moto_server), through the fault proxy where the bucket misbehaves: every output in the
bucket, last.pt naming only whole checkpoints, SIGTERM -> upload -> exit 75 within the bound,
a requeued run on a fresh machine continuing bit-identical from the bucket, 503s, 403s at the
start and mid-run, a SIGKILL mid-upload, no credential in anything the run wrote or printed."""

import io
import json
import logging
import os
import shutil
import signal
import subprocess
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from app.catalog import Catalog
from app.catalog.remote_run import RemoteRunFolder, staging_folder
from app.catalog.storage import DatasetRoot
from app.launch.remote_output import fetched_last, run_dir
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE
from app.runtime import moments
from app.runtime.liveness import descendants, is_alive
from conftest import held_pid, read_line_with, run_driver, run_tool, write_catalog
from s3 import SECRET_KEY, FaultyProxy
from exact_runs import CATALOG, EXACT, SPLITS, assert_bit_identical, driver, metric_rows

ONE_WORKER = (*EXACT, *SPLITS["1 worker"])  # 20 steps an epoch, 2 epochs


def bucket_files(server, bucket: str) -> dict[str, bytes]:
    client = server.client()
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
            for o in listed}


def new_bucket(server, name: str) -> str:
    client = server.client()
    if name not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=name)
    return name


def as_checkpoint(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def grown_to(checkpoint: bytes, size: int) -> bytes:
    """A checkpoint (a zip file) grown to `size` bytes by a zip comment, which loading passes
    over: two checkpoints of one size, as a model's often are."""
    def commented(comment: bytes) -> bytes:
        data = io.BytesIO(checkpoint)
        with zipfile.ZipFile(data, "a") as archive:  # writes its central directory again
            archive.comment = comment
        return data.getvalue()
    return commented(b" " * (size - len(commented(b""))))


def wait_for_step(process, run_dir, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(r.get("step", 0) >= step for r in metric_rows(run_dir)):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_every_output_reaches_the_bucket_and_its_name_is_not_taken_twice(s3_server, tmp_path):
    """The bucket's settings from a catalog entry in the same bucket (its endpoint_url: the
    fault proxy, answering 30% of the requests 503 SlowDown): all the run's files arrive,
    last.pt is a copy of the one step file --keep-checkpoints 1 leaves, and the secret key is
    in nothing the run wrote or printed. The same run name again: refused."""
    new_bucket(s3_server, "team-a")
    proxy = FaultyProxy(s3_server.endpoint, fail_fraction=0.3, seed=3)
    catalog = write_catalog(tmp_path / "datasets.toml", {
        "sample_tiny": {"sample": "tiny"},
        "team": {"url": "s3://team-a/imagenet", "endpoint_url": proxy.endpoint}})
    url = "s3://team-a/runs"
    flags = ("--catalog", str(catalog), "--dataset", "sample_tiny", *ONE_WORKER,
             "--keep-checkpoints", "1", "--output-dir", url, "--run-name", "r")
    try:
        result = run_driver(*flags, cwd=tmp_path)
        files = bucket_files(s3_server, "team-a")
        again = run_driver(*flags, cwd=tmp_path)
        failed = proxy.counts["failed"]
    finally:
        proxy.stop()
    assert result.returncode == 0, result.stderr
    assert failed > 0  # retried until they passed
    assert {k for k in files if not k.startswith("runs/r/checkpoints/")} >= {
        "runs/r/config.toml", "runs/r/metrics.jsonl", "runs/r/curves.png", "runs/r/skipped.tsv"}
    checkpoints = {k.rsplit("/", 1)[1] for k in files if "/checkpoints/" in k}
    assert checkpoints - {"best.pt"} == {"last.pt", "step-000000040.pt"}
    assert files["runs/r/checkpoints/last.pt"] == files["runs/r/checkpoints/step-000000040.pt"]
    assert as_checkpoint(files["runs/r/checkpoints/last.pt"])["step"] == 40
    staged = staging_folder(url) / "r"
    assert files["runs/r/metrics.jsonl"] == (staged / "metrics.jsonl").read_bytes()
    assert f'output_dir = "{url}"' in files["runs/r/config.toml"].decode()
    assert "uploaded checkpoints/step-000000040.pt" in result.stderr and "backlog:" in result.stderr
    written = [*files.values(), *(p.read_bytes() for p in staged.rglob("*") if p.is_file())]
    for text in (result.stdout.encode(), result.stderr.encode(), again.stderr.encode(),
                 *written):
        assert SECRET_KEY.encode() not in text

    assert again.returncode == 2
    assert error_lines(again.stderr) == [
        f"error: {url}/r holds a run already: continue it with --resume auto, or choose "
        "another --run-name"]
    unchanged = bucket_files(s3_server, "team-a")["runs/r/metrics.jsonl"]
    assert unchanged == files["runs/r/metrics.jsonl"]


def test_sigterm_uploads_then_exits_75_and_a_fresh_machine_continues_bit_identical(
        straight, s3_server, tmp_path):
    """The endpoint from AWS_ENDPOINT_URL (the AWS chain). SIGTERM mid-epoch: checkpoint, upload,
    exit 75 within --stop-timeout 30 (GCP's notice); the local staging folder then deleted (a new
    machine), --resume auto continues from the bucket and ends with the uninterrupted run's
    weights; --resume URL of a step file evaluates it on a machine that has no copy, and
    bin/validate.py rates the URL (--pretrained URL) alike."""
    new_bucket(s3_server, "spot")
    url, env = "s3://spot/exp", {"AWS_ENDPOINT_URL": s3_server.endpoint}
    flags = (*CATALOG, *ONE_WORKER, "--run-name", "cut", "--output-dir", url,
             "--stop-timeout", "30")
    staged = staging_folder(url) / "cut"
    process = subprocess.Popen(driver(*flags), cwd=tmp_path, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **env})
    wait_for_step(process, staged, 5)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code, stderr = process.wait(timeout=60), process.stderr.read()
    assert code == PREEMPTED_EXIT_CODE, stderr
    assert time.monotonic() - signalled < 30
    hint = next(line for line in stderr.splitlines() if "to continue: python" in line)
    assert f"saved {url}/cut/checkpoints/last.pt" in hint and "--resume auto" in hint
    cut = as_checkpoint(bucket_files(s3_server, "spot")["exp/cut/checkpoints/last.pt"])
    assert 5 <= cut["step"] < 20

    shutil.rmtree(staging_folder(url))  # the requeued job runs on a machine that never saw it
    resumed = run_driver(*flags, "--resume", "auto", cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr
    files = bucket_files(s3_server, "spot")
    assert_bit_identical(straight("1 worker"), as_checkpoint(files["exp/cut/checkpoints/last.pt"]))
    steps = [r["step"] for r in map(json.loads,
                                    files["exp/cut/metrics.jsonl"].decode().splitlines())]
    assert steps[0] == 1 and steps[-1] == 40  # the record goes on from the first machine's

    shutil.rmtree(staging_folder(url))
    step_url = f"{url}/cut/checkpoints/step-000000040.pt"
    evaluated = run_driver(*CATALOG, *ONE_WORKER, "-e", "--resume", step_url,
                           "--output-dir", str(tmp_path / "local"), cwd=tmp_path, env=env)
    assert evaluated.returncode == 0, evaluated.stderr
    top1 = metric_rows(tmp_path / "local" / "cut")[-1]["val/top1"]  # the URL named the run
    validated = run_tool(  # bin/validate.py: --pretrained URL, through the cache
        "validate.py", step_url, *CATALOG, "-j", "0", "--output-dir", tmp_path / "local",
        cwd=tmp_path, env=env)
    assert validated.returncode == 0, validated.stderr
    assert f"{step_url}: top-1 {top1:.4f}" in validated.stdout


def test_an_upload_that_cannot_finish_in_time_leaves_the_local_checkpoint_named(
        s3_server, tmp_path):
    """The proxy holds every checkpoint upload: after SIGTERM the driver waits out
    --stop-timeout 3, exits 75, and names the local step file and the --resume that continues
    from it; the bucket names no checkpoint."""
    new_bucket(s3_server, "held")
    proxy = FaultyProxy(s3_server.endpoint, hold=("checkpoints/step-",))
    try:
        url, env = "s3://held/exp", {"AWS_ENDPOINT_URL": proxy.endpoint}
        process = subprocess.Popen(
            driver(*CATALOG, *ONE_WORKER, "--run-name", "cut", "--output-dir", url,
                   "--stop-timeout", "3"),
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **env})
        wait_for_step(process, staging_folder(url) / "cut", 3)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code, stderr = process.wait(timeout=60), process.stderr.read()
        elapsed = time.monotonic() - signalled
    finally:
        proxy.stop()
    assert code == PREEMPTED_EXIT_CODE, stderr
    assert 3 <= elapsed < 8, elapsed  # --stop-timeout, and the process's own exit
    hint = next(line for line in stderr.splitlines() if "to continue: python" in line)
    local = hint.split("--resume ", 1)[1].split(" ")[0]
    assert f"saved {local} only on this machine" in hint and local.endswith(".pt")
    assert torch.load(local, map_location="cpu", weights_only=True)["step"] >= 3
    assert not any("checkpoints/" in key for key in bucket_files(s3_server, "held"))


def test_a_sigkill_mid_upload_leaves_last_pt_naming_a_whole_checkpoint(s3_server, tmp_path):
    """Once the bucket's last.pt names a checkpoint, the proxy holds the next checkpoint's
    upload in flight and the driver is killed: the bucket's last.pt is still the earlier, whole
    checkpoint, and the one in flight is not in the bucket at all; the upload process (busy
    with that upload) dies with the driver: no orphan goes on uploading."""
    new_bucket(s3_server, "killed")
    proxy = FaultyProxy(s3_server.endpoint, hold=("checkpoints/step-",),
                        hold_after="checkpoints/last.pt")
    try:
        url = "s3://killed/exp"
        process = subprocess.Popen(
            driver(*CATALOG, *ONE_WORKER, "--run-name", "k", "--output-dir", url),
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint})
        deadline = time.monotonic() + 180
        while not proxy.counts["held"]:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.1)
        children = descendants(process.pid)  # the upload process, the resource tracker
        process.kill()
        process.wait(timeout=30)
        held = proxy.counts["held_paths"][0]
        gone_by = time.monotonic() + 10
        while any(map(is_alive, children)) and time.monotonic() < gone_by:
            time.sleep(0.1)
    finally:
        proxy.stop()
    assert children and not any(map(is_alive, children))
    files = bucket_files(s3_server, "killed")
    in_flight = held.split("/killed/", 1)[1].split("?")[0]
    assert in_flight.startswith("exp/k/checkpoints/step-") and in_flight not in files
    named = as_checkpoint(files["exp/k/checkpoints/last.pt"])
    assert named["step"] in (20, 40) and f"step-{named['step']:09d}.pt" not in in_flight
    copied = f"exp/k/checkpoints/step-{named['step']:09d}.pt"
    assert files["exp/k/checkpoints/last.pt"] == files[copied]


def test_a_bucket_that_refuses_checkpoints_mid_run_keeps_them_local_and_fails_the_run(
        s3_server, tmp_path):
    """Writes pass the pre-flight probe, then every checkpoint upload gets 403: training goes
    on, each file's failure is said once, the checkpoints stay in the staging folder, and the
    run ends with 1, naming where they are."""
    new_bucket(s3_server, "strict")
    proxy = FaultyProxy(s3_server.endpoint, refuse=("checkpoints/",))
    try:
        url = "s3://strict/exp"
        result = run_driver(*CATALOG, *ONE_WORKER, "--run-name", "s", "--output-dir", url,
                            cwd=tmp_path, env={"AWS_ENDPOINT_URL": proxy.endpoint})
    finally:
        proxy.stop()
    assert result.returncode == 1, result.stderr
    for name in ("step-000000020.pt", "step-000000040.pt"):
        said = [line for line in result.stderr.splitlines()
                if f"could not upload checkpoints/{name}" in line]
        assert len(said) == 1 and "403" in said[0], result.stderr
    staged = staging_folder(url) / "s"
    assert torch.load(staged / "checkpoints" / "last.pt", weights_only=True)["step"] == 40
    assert error_lines(result.stderr)[-1].startswith(
        f"error: the upload to {url}/s did not finish (checkpoints/")
    files = bucket_files(s3_server, "strict")
    assert "exp/s/metrics.jsonl" in files and not any("checkpoints" in k for k in files)


def test_writes_refused_then_allowed_again_the_run_ends_with_everything_uploaded(
        s3_server, tmp_path):
    """403 for every write from the first batch on; the worker that saves is held after its
    first save (app/runtime/moments.py) while the run says the refusal, then, allowed again,
    that the uploads caught up (said once); let go with a stop request, the run ends with the
    stop's checkpoint as the bucket's last.pt. No step races the uploader: training is held.
    Two workers: with one, the worker is the driver, whose log a held process cannot write."""
    new_bucket(s3_server, "moody")
    proxy = FaultyProxy(s3_server.endpoint)
    held = tmp_path / "moments"
    held.mkdir()
    try:
        url = "s3://moody/exp"
        process = subprocess.Popen(
            driver(*CATALOG, *EXACT, *SPLITS["2 workers ps"], "--run-name", "m",
                   "--output-dir", url),
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint,
                 moments.PAUSE_AT: "worker:first-batch,checkpoint:saved",
                 moments.PAUSE_DIR: str(held)})
        worker = held_pid(process, held, "worker:first-batch")
        proxy.forbid_writes_now()  # config.toml is claimed: every later write is refused
        os.kill(worker, signal.SIGCONT)
        # The saver is rank 0, which need not be the worker that reached its first batch first.
        saver = held_pid(process, held, "checkpoint:saved")  # epoch 1's, not uploaded
        said = read_line_with(process, "could not upload")
        proxy.forbid_writes_now(False)
        said += read_line_with(process, "uploads work again")
        process.send_signal(signal.SIGTERM)
        os.kill(saver, signal.SIGCONT)  # epoch 1's checkpoint serves the stop, or one step more
        code, stderr = process.wait(timeout=120), said + process.stderr.read()
    finally:
        proxy.stop()
    assert code == PREEMPTED_EXIT_CODE, stderr
    assert "could not upload" in said and "uploads work again" in stderr
    refused = [line.split(" to ")[0] for line in stderr.splitlines() if "could not upload" in line]
    assert refused and len(refused) == len(set(refused))  # once per file, not per attempt
    stopped = as_checkpoint(bucket_files(s3_server, "moody")["exp/m/checkpoints/last.pt"])
    assert stopped["step"] in (20, 21)  # the saver held before it said epoch 1's was whole
    assert f"after step {stopped['step']} " in stderr  # the stop's checkpoint is the bucket's


def test_a_checkpoint_url_replaced_by_one_of_the_same_size_is_resumed_from_the_newer(
        straight, s3_server, tmp_path):
    """--resume s3://.../last.pt twice on one machine, the bucket's last.pt replaced in between
    by a later checkpoint of the same size (a model's checkpoints are): the second run
    evaluates the later one, not this machine's cached copy of the first."""
    straight("1 worker")  # the exact run, once per suite: its step files of epochs 1 and 2
    saved = Path(straight.args[0]) / "runs" / "1-worker" / "checkpoints"
    older, newer = ((saved / f"step-{step:09d}.pt").read_bytes() for step in (20, 40))
    size = max(len(older), len(newer))
    older, newer = grown_to(older, size), grown_to(newer, size)
    assert len(older) == len(newer) and older != newer  # what a size cannot tell apart
    client = s3_server.client()
    new_bucket(s3_server, "replaced")
    url = "s3://replaced/exp/r/checkpoints/last.pt"
    for body, step in ((older, 20), (newer, 40)):
        client.put_object(Bucket="replaced", Key="exp/r/checkpoints/last.pt", Body=body)
        result = run_driver(*CATALOG, *ONE_WORKER, "-e", "--resume", url, "--run-name",
                            f"at-{step}", "--output-dir", str(tmp_path / "local"), cwd=tmp_path,
                            env={"AWS_ENDPOINT_URL": s3_server.endpoint})
        assert result.returncode == 0, result.stderr
        assert metric_rows(tmp_path / "local" / f"at-{step}")[-1]["step"] == step
    assert f"downloading {url} " in result.stderr  # again: the copy here is of the first one
    assert "(the copy here is not its source's version now)" in result.stderr


def test_a_run_resumed_on_a_machine_it_left_keeps_the_epochs_others_added(
        s3_server, tiny_sample, tmp_path):
    """Machine a trains epoch 1, machine b (another cache folder, so another staging folder)
    epoch 2, machine a again epoch 3, each with --resume auto: a takes the bucket's record
    over its own older one, so the bucket's metrics.jsonl holds every epoch once, in order."""
    new_bucket(s3_server, "moving")
    catalog = write_catalog(tmp_path / "datasets.toml", {"tiny": {"url": str(tiny_sample)}})
    url = "s3://moving/exp"
    for machine, epochs in (("a", 1), ("b", 2), ("a", 3)):
        result = run_driver("--catalog", str(catalog), *ONE_WORKER, "--epochs", str(epochs),
                            "--run-name", "m", "--output-dir", url,
                            *(("--resume", "auto") if epochs > 1 else ()), cwd=tmp_path,
                            env={"AWS_ENDPOINT_URL": s3_server.endpoint,
                                 "IMAGENET_DP_CACHE": str(tmp_path / machine)})
        assert result.returncode == 0, result.stderr
    files = bucket_files(s3_server, "moving")
    rows = [json.loads(line) for line in files["exp/m/metrics.jsonl"].decode().splitlines()]
    assert [row["epoch"] for row in rows if "val/top1" in row] == [1, 2, 3]
    assert [row["step"] for row in rows if "val/top1" not in row] == list(range(1, 61))
    assert as_checkpoint(files["exp/m/checkpoints/last.pt"])["step"] == 60
    said = next(line for line in result.stderr.splitlines() if "replaced this machine's" in line)
    assert "metrics.jsonl" not in said  # a's own was the beginning of the bucket's: nothing lost


def test_resume_auto_keeps_a_record_that_went_on_here_and_else_takes_the_buckets(
        s3_server, tmp_path, monkeypatch, caplog):
    """What --resume auto takes of the bucket's record on a machine that has one of its own:
    this machine's metrics.jsonl where it goes on from the bucket's (a stop whose upload of the
    record did not finish), the bucket's skipped.tsv where this machine's is its beginning, the
    bucket's curves.png where they differ (this machine's kept aside, hidden, and said). A
    second resume, nothing changed, downloads nothing."""
    monkeypatch.setenv("IMAGENET_DP_CACHE", str(tmp_path / "machine"))
    caplog.set_level(logging.INFO, logger="imagenet_dp")
    client = s3_server.client()
    new_bucket(s3_server, "record")
    bucket = {"checkpoints/last.pt": b"weights", "metrics.jsonl": b"1\n2\n",
              "skipped.tsv": b"path\nx.jpg\n", "curves.png": b"new"}
    for key, body in bucket.items():
        client.put_object(Bucket="record", Key=f"exp/r/{key}", Body=body)
    staged = run_dir("s3://record/exp", "r")
    mine = {"metrics.jsonl": b"1\n2\n3\n", "skipped.tsv": b"path\n", "curves.png": b"old"}
    for name, body in mine.items():
        (staged / name).parent.mkdir(parents=True, exist_ok=True)
        (staged / name).write_bytes(body)
    catalog = Catalog.load(write_catalog(tmp_path / "datasets.toml", {
        "b": {"url": "s3://record/data", "endpoint_url": s3_server.endpoint}}))
    last = Path(fetched_last(catalog, "s3://record/exp", "r"))
    assert last == staged / "checkpoints" / "last.pt" and last.read_bytes() == b"weights"
    assert {name: (staged / name).read_bytes() for name in mine} == {
        "metrics.jsonl": b"1\n2\n3\n", "skipped.tsv": b"path\nx.jpg\n", "curves.png": b"new"}
    assert (staged / ".curves.png.replaced").read_bytes() == b"old"
    said = [r.getMessage() for r in caplog.records if "replaced this machine's" in r.getMessage()]
    assert said == ["--resume auto: the bucket's curves.png replaced this machine's, which held "
                    "what the bucket's lacks (kept beside as .<name>.replaced)"]
    before = {path: path.stat().st_mtime_ns for path in staged.rglob("*")}
    assert Path(fetched_last(catalog, "s3://record/exp", "r")) == last
    assert {path: path.stat().st_mtime_ns for path in staged.rglob("*")} == before


@pytest.mark.parametrize("bucket", ["missing", "forbidden"])
def test_a_bucket_that_takes_no_writes_stops_the_run_before_any_worker(s3_server, tmp_path,
                                                                      bucket):
    proxy = FaultyProxy(s3_server.endpoint, forbid_writes=True) if bucket == "forbidden" \
        else None
    new_bucket(s3_server, "forbidden")
    try:
        result = run_driver(*CATALOG, *ONE_WORKER, "--run-name", "x",
                            "--output-dir", f"s3://{bucket}/exp", cwd=tmp_path,
                            env={"AWS_ENDPOINT_URL": (proxy or s3_server).endpoint})
    finally:
        if proxy:
            proxy.stop()
    assert result.returncode == 2, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and f"cannot write s3://{bucket}/exp/x" in lines[0], result.stderr
    assert ("403" if bucket == "forbidden" else "no such bucket") in lines[0]
    assert "started" not in result.stderr
    assert not (staging_folder(f"s3://{bucket}/exp") / "x" / "config.toml").exists()


def test_two_runs_that_take_one_name_at_the_same_moment_one_is_refused(s3_server):
    """The name is claimed by a conditional write of config.toml (If-None-Match: *), not by
    looking first: of eight claims at once, exactly one wins, and its bytes are what the
    bucket holds. (The driver's refusal of a taken name: the first test.)"""
    new_bucket(s3_server, "race")
    store = DatasetRoot("run", "s3://race/exp/same",
                        {"endpoint_url": s3_server.endpoint})
    contenders = [f"run {i}".encode() for i in range(8)]
    with ThreadPoolExecutor(len(contenders)) as pool:
        won = list(pool.map(lambda data: RemoteRunFolder(store).claim("config.toml", data),
                            contenders))
    assert won.count(True) == 1
    assert bucket_files(s3_server, "race")["exp/same/config.toml"] == contenders[won.index(True)]

"""--output-dir at a URL: the run folder is staged on this machine and mirrored to the bucket by
the upload process (app/catalog/uploader.py). The bucket is checked, and the run's name claimed,
before any worker starts; at the end the driver waits for the uploads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

from app.catalog import Catalog
from app.catalog.fetcher import CHUNK_BYTES, fetch, fetch_to
from app.catalog.locations import MODELS
from app.catalog.remote_run import RemoteRunFolder, is_url, refusal, staging_folder
from app.catalog.retry import request_errors
from app.catalog.storage import DatasetRoot
from app.catalog.uploader import Mirrored, UploadProcess
from app.runtime.errors import UserError
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE, seconds_since_stop_signal
from app.training.job import TrainJob

log = logging.getLogger("imagenet_dp")
# The most the driver waits for the last uploads of a run that ends on its own (a 10 GB
# checkpoint at 100 MB/s takes 100 s); after a stop request, --stop-timeout rules.
FINISH_TIMEOUT_S = 600.0
LAST = "checkpoints/last.pt"  # in the bucket: a copy of the newest whole upload


def run_store(catalog: Catalog, output_dir: str, name: str) -> DatasetRoot | None:
    """The run folder's store when --output-dir is a URL (None for a local folder)."""
    return catalog.location(f"{output_dir.rstrip('/')}/{name}") if is_url(output_dir) else None


def run_dir(output_dir: str, name: str) -> Path:
    """Where the run writes: its folder, or for a URL its staging folder on this machine."""
    return (staging_folder(output_dir) if is_url(output_dir) else Path(output_dir)) / name


def fetched_checkpoint(catalog: Catalog, url: str) -> tuple[str, str]:
    """(local copy, run name the URL implies or "") of `--resume URL`."""
    local = fetch(catalog.location(url), MODELS, report=log.info)
    parts = url.rstrip("/").split("/")
    name = parts[-3] if len(parts) > 3 and parts[-2] == "checkpoints" else ""
    return str(local), name


def fetched_last(catalog: Catalog, output_dir: str, name: str) -> str:
    """`--resume auto` for a bucket's run: its last.pt (the last completed upload) and its record
    (the files beside checkpoints/), each fetched into the staging folder unless this machine's
    copy is the bucket's version already; "" without a checkpoint yet. The bucket's record goes
    on, not over: a machine that ran the run before takes what other machines added since."""
    remote = RemoteRunFolder(run_store(catalog, output_dir, name))
    local = run_dir(output_dir, name)
    try:
        files = sorted(remote.sizes())
    except FileNotFoundError:
        files = []
    except request_errors() as error:
        raise UserError(f"--resume auto: cannot list {remote.describe()} ({refusal(error)}); "
                        "check the credentials and --output-dir") from None
    if LAST not in files:
        log.info("--resume auto: no %s yet, starting a new run", remote.describe(LAST))
        return ""
    replaced: list[str] = []
    for relative in files:
        if not relative.startswith("checkpoints/"):
            fetch_to(local / relative, remote.root, relative,
                     keep=lambda mine, bucket: grown_here(mine, bucket, replaced))
    if replaced:
        log.info("--resume auto: the bucket's %s replaced this machine's, which held what the "
                 "bucket's lacks (kept beside as .<name>.replaced)", ", ".join(replaced))
    log.info("--resume auto: continuing from %s", remote.describe(LAST))
    return str(fetch_to(local / LAST, remote.root, LAST, report=log.info))


def grown_here(local: Path, bucket: Path, replaced: list[str]) -> bool:
    """Whether this machine's record file is kept over the bucket's: only where it goes on from
    it (the bucket's bytes are its beginning: a stop whose last upload of the record did not
    finish); it is uploaded then. Otherwise the bucket's replaces it, and one that held bytes
    the bucket's lacks is kept aside, hidden (no upload takes it), and named in `replaced`."""
    if starts_with(local, bucket):
        return True
    if not starts_with(bucket, local):
        os.replace(local, local.with_name(f".{local.name}.replaced"))
        replaced.append(local.name)
    return False


def starts_with(path: Path, beginning: Path) -> bool:
    """Whether `path`'s bytes begin with all of `beginning`'s."""
    if path.stat().st_size < beginning.stat().st_size:
        return False
    with open(path, "rb") as whole, open(beginning, "rb") as start:
        while chunk := start.read(CHUNK_BYTES):
            if whole.read(len(chunk)) != chunk:
                return False
    return True


def check_bucket(store: DatasetRoot, resuming: bool, config_toml: str) -> None:
    """The bucket takes writes, and a new run claims its name by writing config.toml only where
    none is (of two runs starting with one name at once, one is refused)."""
    remote = RemoteRunFolder(store)
    remote.check_writable()
    if not resuming and not remote.claim("config.toml", config_toml.encode()):
        raise UserError(f"{remote.describe()} holds a run already: continue it with --resume "
                        "auto, or choose another --run-name")


def start_uploads(job: TrainJob, primary: bool) -> tuple[UploadProcess | None, TrainJob]:
    """On the primary, for a bucket's run: the upload process, and the job carrying its inbox."""
    if not (job.output_store and primary):
        return None, job
    uploader = UploadProcess(Path(job.run_dir), RemoteRunFolder(job.output_store),
                             job.config.run.keep_checkpoints, log.info)
    return uploader, dataclasses.replace(job, uploads=uploader.uploads)


def finish_uploads(uploader: UploadProcess | None, code: int, stop_timeout: float
                   ) -> tuple[int, Mirrored | None]:
    """Wait for the last uploads (after a stop request: what is left of --stop-timeout since
    the signal). A run that ended well but left files only here ends with 1."""
    if uploader is None:
        return code, None
    since = seconds_since_stop_signal()
    stopped = code == PREEMPTED_EXIT_CODE
    # after a stop request, whatever ended the run: what is left of --stop-timeout
    budget = FINISH_TIMEOUT_S if since is None else max(stop_timeout - since, 0.0)
    mirrored = uploader.finish(budget)
    if not mirrored.waiting:
        log.info("run folder uploaded to %s (%.1f s of uploading in all)",
                 uploader.remote.describe(), uploader.busy_s)
        return code, mirrored
    waiting = ", ".join(mirrored.waiting[:3]) + (" ..." if len(mirrored.waiting) > 3 else "")
    if not stopped:  # after a stop the resume hint names the local checkpoint
        print(f"error: the upload to {uploader.remote.describe()} did not finish ({waiting} "
              f"not uploaded); they stay in {uploader.local}, and the run goes on from there "
              f"with --resume {uploader.local / 'checkpoints' / 'last.pt'}", file=sys.stderr)
    return (1 if code == 0 else code), mirrored


def stop_hint(store: DatasetRoot, local_last: Path, mirrored: Mirrored | None) -> tuple[str, str]:
    """(what holds the stop's checkpoint, the --resume that continues from it): the bucket once
    its last.pt copies the stop's step file, even if older files were still waiting."""
    if mirrored is not None and mirrored.newest_named:
        name = Path(mirrored.newest).name
        return f"{store.describe('checkpoints/last.pt')} (a copy of {name})", "auto"
    target = local_last.parent / Path(mirrored.newest).name if mirrored and mirrored.newest \
        else local_last
    return (f"{target} only on this machine (its upload to {store.describe()} did not finish "
            "within --stop-timeout)", str(target))

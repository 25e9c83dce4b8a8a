"""From a parsed config to a running job: dataset, tables, run folder, resume point, workers."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import string
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable
from urllib.parse import urlsplit

from app.catalog import skipped
from app.catalog import Catalog
from app.catalog.remote_run import is_url
from app.catalog.tables import load_tables
from app.config import Config, DataConfig, ParallelConfig, RunConfig
from app.config.sources import dump_toml, parse_config
from app.data.resolution import Resolution, resolve
from app.launch import hints, remote_output
from app.runtime import forkserver, slurm
from app.runtime.devices import LaunchEnv
from app.runtime.errors import UserError
from app.runtime.files import write_atomically
from app.runtime.forkserver import ByName
from app.runtime.moments import moment
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE, StopRequested, caught_for_a_call
from app.training.job import TrainJob

if TYPE_CHECKING:
    from app.parallel.restarts import Restart

log = logging.getLogger("imagenet_dp")
DEFAULT_IMAGE_SIZE = 224
# The driver's worker, by name: the driver itself never imports the training loop (torch, timm)
WORKER = ByName("app.launch.worker", "train_process")


def main(argv: list[str]) -> int:
    """A run, under this process's stop signals (bin/driver.py installed them at its start;
    from a caller in Python, for this call)."""
    with caught_for_a_call():
        return run_main(argv)


def run_main(argv: list[str]) -> int:
    config, _ = parse_config(argv)
    launch = LaunchEnv.from_environ(os.environ)
    config = with_job_run_name(config, launch, os.environ)
    if launch:
        check_launched(config, launch)
    elif starts_processes(config.parallel, config.run):
        # the forkserver imports what the workers need while this process resolves the job
        forkserver.start(worker_imports(config))
    job = prepare_job(config)
    from app.parallel.plans import choose_sync  # noqa: PLC0415
    from app.runtime.devices import worker_devices  # noqa: PLC0415
    from app.training import preflight  # noqa: PLC0415
    from app.training.batch_layout import resumed_job  # noqa: PLC0415
    parallel = config.parallel
    devices = worker_devices(parallel.gpus, parallel.devices, config.train.device)
    mode = choose_sync(parallel.sync, devices, launch)
    primary = not (launch and launch.rank)
    job = resumed_job(job, launch.world_size if launch else len(devices),  # the same samples
                      report=log.info if primary else print_nothing)
    if config.model.pretrained and not job.resume_from:  # a resumed run has its weights
        check_pretrained(job, primary)
    if job.output_store and primary:  # before any worker starts: the bucket takes writes
        remote_output.check_bucket(job.output_store, resuming=bool(config.run.resume),
                                   config_toml=dump_toml(job.config))
    write_run_folder(job)  # first: it also shows that the output folder is writable
    preflight.check(job, saves=primary)
    uploader, job = remote_output.start_uploads(job, primary)
    try:
        if launch:
            from app.launch.worker import launched_process  # noqa: PLC0415 (torch: a worker)
            code = launched_process(job, launch, launched_device(devices, launch))
        else:
            code = run_group(job, devices, mode)
    except StopRequested as stop:  # before the first step, or asked again: nothing more saved
        print(f"stopped by {stop.name} at once", file=sys.stderr)
        code = PREEMPTED_EXIT_CODE
    code, mirrored = remote_output.finish_uploads(uploader, code, job.config.run.stop_timeout)
    if code == PREEMPTED_EXIT_CODE and primary:
        print(hints.resume_hint(job, mirrored), file=sys.stderr)
    moment("driver:end")
    return code


def starts_processes(parallel: ParallelConfig, run: RunConfig) -> bool:
    """Whether the driver starts worker processes (from the forkserver): several workers, or
    one that --max-restarts may have to replace; threads and a single worker run here."""
    several = len(parallel.devices) > 1 or parallel.gpus > 1
    return (several and parallel.replicas_as != "threads") or run.max_restarts > 0


def worker_imports(config: Config) -> list[str]:
    """What the run's processes import as they start, which the forkserver imports once for all
    of them (the primary's loggers import their own libraries themselves)."""
    modules = [WORKER.module, "app.models.factory", "app.parallel.ps_server",
               "app.parallel.ps_worker", "app.parallel.allreduce", "app.data.pillow_pipeline",
               "fsspec"]  # every reader opens the dataset through fsspec
    if config.data.decoder == "nvjpeg":
        modules.append("app.data.nvjpeg_pipeline")
    return [*modules, "app.models.timm_lib"]  # every model the driver builds by name is timm's


def with_job_run_name(config: Config, launch: LaunchEnv | None, environ) -> Config:
    """Inside a Slurm job, the job names the run unless --run-name does: every task agrees on
    it without being told, and a requeued job (same id) continues it with --resume auto. Only
    for a launched group or --resume auto: two plain runs in one allocation keep their own."""
    name = slurm.run_name(environ)
    if config.run.name or not name or not (launch or config.run.resume == "auto"):
        return config
    return dataclasses.replace(config, run=dataclasses.replace(config.run, name=name))


def check_launched(config: Config, launch: LaunchEnv) -> None:
    """What a process started by torchrun or srun cannot be asked for."""
    if not config.run.name:
        raise UserError(f"under {launch.launcher} pass --run-name: every process must agree on "
                        "the run folder")
    if config.run.max_restarts:
        restarts = {"srun": "under srun, Slurm starts the job again: submit it with sbatch "
                            "--requeue",
                    "mpirun": "mpirun does not start a rank again: run the job again (sbatch "
                              "--requeue under Slurm)",
                    "torchrun": "under torchrun, torchrun restarts the processes: give it "
                                "--max-restarts (before bin/driver.py)"}
        raise UserError(f"{restarts[launch.launcher]} and give the driver --resume auto "
                        "instead of run.max_restarts")
    host = urlsplit(launch.init_method).hostname
    if launch.launcher != "torchrun" and launch.rank == 0 and not slurm.is_this_machine(host):
        # the others would wait for rank 0 at `host` until --sync-timeout
        where = "the first node of the step" if launch.launcher == "srun" else "MASTER_ADDR"
        task = "task" if launch.launcher == "srun" else "rank"
        raise UserError(f"{task} 0 runs on {socket.gethostname()}, but the {task}s meet at "
                        f"{host} ({where}): set MASTER_ADDR to {task} 0's host")
    launch.check_one_device_each(config.parallel.gpus, config.parallel.devices)


def check_pretrained(job: TrainJob, primary: bool) -> None:
    """--pretrained weights that do not fit stop the run here, before any worker starts; a
    re-initialised classifier is reported once (by the primary), not by every worker."""
    from app.models import pretrained  # noqa: PLC0415
    from app.models.factory import create_model_from_config  # noqa: PLC0415
    model = create_model_from_config(dataclasses.replace(job.config.model, pretrained=""),
                                     job.tables.num_classes)
    warning = pretrained.check(model, job.config.model.pretrained, job.tables.wnids,
                               job.config.run.evaluate, log.info if primary else print_nothing)
    if warning and primary:
        log.warning("%s", warning)


def print_nothing(line: str) -> None:
    """What the other ranks of a launched group report: the primary has said it."""


def run_group(job: TrainJob, devices: list[str], mode: str) -> int:
    """The driver's worker processes; with --max-restarts N started again, after a failure,
    from this run's newest checkpoint (app/parallel/restarts.py)."""
    from app.parallel.launcher import Stopping, launch  # noqa: PLC0415
    from app.parallel.restarts import run_with_restarts  # noqa: PLC0415
    run = job.config.run
    stopping = Stopping(run.checkpoint_interval, run.stop_timeout)
    if job.config.parallel.replicas_as == "threads" and len(devices) > 1:
        from app.parallel.threads import run_threads  # noqa: PLC0415
        return run_threads(WORKER, with_eager_threads(job), devices, job.config.parallel,
                           stopping)

    def start(on_failure: Callable[[str], None]) -> int:
        return launch(WORKER, job, devices, mode, job.config.parallel, stopping,
                      on_failure, replaceable=run.max_restarts > 0,
                      preload=tuple(worker_imports(job.config)))

    def prepare(restart: Restart) -> str:
        nonlocal job
        job = resumed_from_newest(job)
        return record_restart(job, restart)

    return run_with_restarts(start, run.max_restarts, prepare)


def with_eager_threads(job: TrainJob) -> TrainJob:
    """torch.compile is not thread-safe (app/config/checks.py refuses --compile on with
    threads): `auto` means eager for replicas that are threads."""
    train = job.config.train
    if train.compile != "auto":
        return job
    return dataclasses.replace(job, config=dataclasses.replace(
        job.config, train=dataclasses.replace(train, compile="off")))


def resumed_from_newest(job: TrainJob) -> TrainJob:
    """The job continuing from this run's last.pt (unchanged while the run has none yet)."""
    last = job.checkpoint_dir / "last.pt"
    if not last.is_file():
        return job
    config = job.config
    return dataclasses.replace(job, resume_from=str(last), config=dataclasses.replace(
        config, run=dataclasses.replace(config.run, resume=str(last))))


def record_restart(job: TrainJob, restart: Restart) -> str:
    """The restart as a record in metrics.jsonl (`"event": "restart"`, at the step the group
    continues from); returns where that is, in words."""
    from app.loggers.jsonl import JsonlLogger  # noqa: PLC0415
    from app.training import checkpoint  # noqa: PLC0415
    state = checkpoint.load(job.resume_from, mmap=True) if job.resume_from else {"step": 0}
    metrics = JsonlLogger(Path(job.run_dir) / "metrics.jsonl")
    metrics.log_metrics(state["step"], {
        "event": "restart", "restart": restart.number, "max_restarts": restart.limit,
        "cause": restart.cause, "resume_from": job.resume_from, "backoff_s": restart.backoff_s})
    metrics.finish()
    if not job.resume_from:
        return "from the start (no checkpoint yet)"
    return f"from {job.resume_from} {hints.position(state)}"


def launched_device(devices: list[str], launch: LaunchEnv) -> str:
    """This process's device: a launcher starts one process per GPU (LaunchEnv.device)."""
    import torch  # noqa: PLC0415
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return launch.device(devices[0], visible, bound="SLURM_GPUS_PER_TASK" in os.environ)


def prepare_job(config: Config) -> TrainJob:
    """Resolve everything a worker needs: dataset, tables, image size, run name, resume."""
    catalog = Catalog.load(config.data.catalog)
    resume_from, name = resolve_resume(config, catalog)
    root = catalog.open(config.data.dataset, report=log.info)
    tables = load_tables(root, config.data.classes, config.data.train_index)
    for note in tables.notes:
        log.warning("%s", note)
    image_size = config.data.image_size or root.image_size or DEFAULT_IMAGE_SIZE
    resolution = resolution_of(config.data, image_size)
    name = name or f"{root.name}-{config.model.arch}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = remote_output.run_dir(config.run.output_dir, name)  # a URL's: staged here
    store = remote_output.run_store(catalog, config.run.output_dir, name)
    run_id = resumed_run_id(resume_from) or new_run_id()
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, dataset=root.name, image_size=image_size),
        run=dataclasses.replace(config.run, name=name, resume=resume_from))
    return TrainJob(config, root, tables, resolution, str(run_dir), resume_from, run_id,
                    output_store=store)


def resolution_of(data: DataConfig, image_size: int) -> Resolution:
    """Train size per epoch, val resize and crop, from the data section's sizes."""
    return resolve(image_size, train_crop=data.train_crop_size, val_resize=data.val_resize_size,
                   val_crop=data.val_crop_size,
                   progressive=(data.progressive_start_size, data.progressive_end_size,
                                data.progressive_start_epoch, data.progressive_end_epoch))


def resolve_resume(config: Config, catalog: Catalog) -> tuple[str, str]:
    """(checkpoint to resume from or "", run name). `auto` means this run's last.pt, if any;
    resuming from runs/<name>/checkpoints/X.pt continues run <name> unless --run-name says
    otherwise. URLs (a checkpoint's, an --output-dir's) are fetched into the cache first."""
    resume, name = config.run.resume, config.run.name
    if resume and resume != "auto" and is_url(resume):
        local, implied = remote_output.fetched_checkpoint(catalog, resume)
        return local, name or implied
    if resume == "auto":
        if not name:
            raise UserError("--resume auto needs --run-name (the run whose last.pt to continue)")
        if is_url(config.run.output_dir):
            return remote_output.fetched_last(catalog, config.run.output_dir, name), name
        last = Path(config.run.output_dir) / name / "checkpoints" / "last.pt"
        if not last.is_file():
            log.info("--resume auto: no %s yet, starting a new run", last)
            return "", name
        return str(last), name
    if resume:
        path = Path(resume)
        if not path.is_file():
            raise UserError(f"--resume {resume}: no such checkpoint file")
        if not name and path.parent.name == "checkpoints":
            name = path.parent.parent.name
        return str(path), name
    return "", name


def new_run_id() -> str:
    """8 lowercase letters and digits, the shape of wandb's own run ids."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def resumed_run_id(checkpoint_path: str) -> str:
    """The run id stored in the checkpoint we resume from ("" for a fresh start): a resumed run
    continues the same wandb run. Also rejects a broken checkpoint before any process starts."""
    if not checkpoint_path:
        return ""
    from app.training import checkpoint  # noqa: PLC0415 (imports torch: only when resuming)
    return checkpoint.load(checkpoint_path, mmap=True).get("run_id", "")


def write_run_folder(job: TrainJob) -> None:
    """Create runs/<name>/ with the resolved config.toml (atomically: several processes under
    a launcher write it at once) and the header of skipped.tsv."""
    path = Path(job.run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        write_atomically(path / "config.toml", dump_toml(job.config))
        skipped.create(path)
    except OSError as error:
        raise UserError(f"cannot write the run folder {path}: {error.strerror}; choose another "
                        "--output-dir") from None
    log.info("run %s: %s, %d classes, %d train / %d val images, %s, outputs in %s",
             job.config.run.name, job.root.name, job.tables.num_classes, len(job.tables.train),
             len(job.tables.val), job.resolution.describe(job.config.train.epochs),
             f"{job.output_store.url} (staged in {path})" if job.output_store else path)

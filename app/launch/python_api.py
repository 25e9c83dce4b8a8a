"""The Python API: open_catalog, prepare_training, train (and app.logging_to, app/loggers).

It builds the driver's TrainJob (app/launch/run.py) from arguments instead of flags, with the
caller's objects as the run's Parts, and runs it in replica threads (the default) or the
driver's worker processes, watched from the caller's thread: it delivers the primary's log
records and turns an interrupt into a checkpoint and an early return. See docs/python-api.md.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch.nn as nn

from app.catalog import Catalog
from app.catalog.dataset import Split
from app.catalog.remote_run import is_url
from app.catalog.tables import Tables
from app.config import Config
from app.launch import api_inputs
from app.launch.run import (DEFAULT_IMAGE_SIZE, new_run_id, resolution_of, resumed_run_id,
                            write_run_folder)
from app.launch.worker import ApiJob, api_replica
from app.loggers import run_outputs
from app.loggers.history import epoch_history
from app.loggers.objects import current_logger, start_loggers
from app.loggers.relay import deliver
from app.parallel.stopping import Stopping
from app.runtime.errors import UserError
from app.runtime.stop_signals import PREEMPTED_EXIT_CODE, StopRequested, caught_for_a_call
from app.training import preflight, run_state
from app.training.batch_layout import resumed_job
from app.training.job import TrainJob
from app.training.user_parts import UserParts

log = logging.getLogger("imagenet_dp")


def open_catalog(path: str | Path = "datasets.toml") -> Catalog:
    """The dataset catalog: ./datasets.toml (else the project's), or the one at `path`."""
    return Catalog.load(path)


@dataclass
class TrainingSetup:
    """What prepare_training checked and resolved; app.train runs it. After a call,
    `model` holds the trained weights and `run_dir` the run's outputs."""
    model: nn.Module
    train_set: Split
    devices: list[str]
    optimizer: Any
    config: Config  # resolved: run name, image size, replicas as threads or processes
    knobs: dict[str, Any]
    config_file: str = ""

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run.output_dir) / self.config.run.name

    @property
    def parallel(self) -> str:
        return self.config.parallel.replicas_as

    def __repr__(self) -> str:
        return (f"TrainingSetup({type(self.model).__name__} on {self.train_set!r}, devices "
                f"{self.devices} as {self.parallel}, run_dir {self.run_dir})")


def prepare_training(model: nn.Module, train_set: Split, devices: Any = "all",
                     optimizer: Any = None, batch_size: int | None = None,
                     epochs: int | None = None, image_size: int | None = None,
                     parallel: str = "", config: str = "", **knobs: Any) -> TrainingSetup:
    """Check and resolve a run of `model` on `train_set` (from catalog.dataset(...)):

    devices: ["cuda:0", "cuda:1"], ["cpu", "cpu"], "all" (every GPU, else one CPU) or a count.
    optimizer: an instance built on model.parameters() (each replica gets its own of the
        same class, groups and hyperparameters), a function parameters -> optimizer, or None
        / a name (sgd, adamw, lars, lamb): the config's, its LR per 256 images.
    batch_size: per device; epochs; image_size: the train and val crop (default: the
        dataset's, else 224).
    parallel: "threads" (default: a thread per device in this process, nothing pickled) or
        "processes" (the driver's worker processes: model, loss and optimizer must pickle).
    config: a run config (TOML) under the keywords; knobs: any of its keys, as the driver's
        flags name them (label_smoothing=0.1, decoder="dali", ...), except those your own
        objects replace (arch, lr, ...): ignored from the file (with a warning), refused here.
    Every mistake is a UserError naming the argument, raised here, before anything runs."""
    resolved = api_inputs.resolve_devices(devices)
    sizes = {"batch_size": batch_size, "epochs": epochs, "image_size": image_size}
    knobs = {**knobs, **{k: v for k, v in sizes.items() if v is not None}}
    if not isinstance(train_set, Split):
        raise UserError(f"train_set: got {type(train_set).__name__}; pass "
                        "catalog.dataset(name).solutions(...) or .split(\"train\")")
    resolved_config = api_inputs.api_config(knobs, config, optimizer, parallel, resolved)
    image = resolved_config.data.image_size or train_set.root.image_size or DEFAULT_IMAGE_SIZE
    api_inputs.check_model(model, train_set.num_classes, image)
    api_inputs.check_optimizer(optimizer, model)
    kind = type(model)
    arch = f"{kind.__module__}.{kind.__qualname__}"  # a class, not a name the factory knows
    run = resolved_config.run
    if is_url(run.output_dir):  # the uploader and the bucket's checks live in the driver
        raise UserError(f"output_dir={run.output_dir!r}: a run folder in a bucket is for "
                        "bin/driver.py --output-dir; from Python give a local folder")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = run.name or reserved_run_name(Path(run.output_dir),
                                         f"{train_set.root.name}-{kind.__name__.lower()}-{stamp}")
    resolved_config = dataclasses.replace(
        resolved_config,
        data=dataclasses.replace(resolved_config.data, dataset=train_set.root.name,
                                 image_size=image, classes=list(train_set.classes.wnids)),
        model=dataclasses.replace(resolved_config.model, arch=arch),
        run=dataclasses.replace(run, name=name))
    return TrainingSetup(model, train_set, resolved, optimizer, resolved_config, knobs, config)


def reserved_run_name(output_dir: Path, name: str) -> str:
    """`name`, else name-2, name-3, ...: the first whose folder this call creates, so setups
    prepared within one second (in a loop, or in two notebooks) get runs of their own."""
    candidate, number = name, 1
    while True:
        try:
            (output_dir / candidate).mkdir(parents=True)
            return candidate
        except FileExistsError:
            number += 1
            candidate = f"{name}-{number}"
        except OSError as error:
            raise UserError(f"cannot write the run folder {output_dir / candidate}: "
                            f"{error.strerror}; pass another output_dir=") from None


def train(setup: TrainingSetup, loss: Any = None, val: Split | None = None, schedule: Any = None,
          logger: Any = None, resume: bool | str = False) -> pd.DataFrame:
    """Train the setup; returns its history, one row per epoch (train loss, val top-1/top-5,
    val loss, images/s, LR, time). loss: (logits, targets) -> scalar tensor (None: the
    config's). val: a Split of the same classes (None: the dataset's val split). schedule:
    None (constant), (epoch, step) -> LR factor, optimizer -> torch LR scheduler, or a name
    of the config's (cosine, step, poly, ffcv). logger: app.loggers objects or a list (None:
    the enclosing app.logging_to's, else the console's, or the notebook's in Jupyter).
    resume: True continues setup.run_dir's last checkpoint, "auto" if there is one.
    An interrupt saves a checkpoint after the current step and returns the history so far."""
    api_inputs.check_loss(loss, setup.train_set.num_classes, setup.config)
    api_inputs.check_schedule(schedule, setup.config)
    replaced = api_inputs.replaced(setup.optimizer, loss, schedule)
    api_inputs.refuse_replaced_knobs(setup.knobs, replaced)
    config = api_inputs.with_defaults(setup.config, [arg for arg in ("loss", "schedule")
                                                     if arg in replaced])
    if isinstance(schedule, str):  # one of the config's schedules, by name
        config = dataclasses.replace(config, optim=dataclasses.replace(config.optim,
                                                                       schedule=schedule))
    parts = UserParts(setup.model, setup.optimizer, schedule, loss)
    if not in_threads(setup):
        api_inputs.check_picklable({"model": parts.model_template, "loss": parts.loss,
                                    "optimizer": parts.optimizer_spec, "schedule": schedule})
    job = train_job(setup, config, val_split(setup, val), resume_point(setup, resume))
    job = resumed_job(job, len(setup.devices))  # on other devices: the same global batch
    ignored = api_inputs.ignored_from_file(setup.config_file, replaced)
    if ignored:
        log.warning("%s", ignored)
    write_run_folder(job)
    preflight.check(job, saves=True)
    # where the primary replica's log records wait for the caller's thread
    relay_queue = queue.Queue() if in_threads(setup) else \
        multiprocessing.get_context("forkserver").Queue()
    loggers = start_loggers(logger if logger is not None else current_logger(), job.run_info(),
                            always=run_outputs(job.run_info()))
    try:
        with caught_for_a_call():  # the caller's own handlers (a notebook's) before and after
            code = stopped_at_once_or(lambda: run_replicas(
                setup, ApiJob(job, parts, relay_queue), lambda: deliver(relay_queue, loggers)))
    finally:
        deliver(relay_queue, loggers)
        loggers.finish()
    last = job.checkpoint_dir / "last.pt"
    if last.is_file():  # the trained weights, BatchNorm statistics averaged over the replicas
        setup.model.load_state_dict(run_state.trained_weights(last))
    if code == PREEMPTED_EXIT_CODE:
        print(f"stopped: saved {last}; continue with app.train(setup, ..., resume=True)"
              if last.is_file() else "stopped before the first checkpoint: nothing saved",
              file=sys.stderr)
    return epoch_history(job.run_dir + "/metrics.jsonl")


def stopped_at_once_or(run: Callable[[], int]) -> int:
    """`run()`, or PREEMPTED_EXIT_CODE where a stop request ended it at once (asked again, or
    before the replicas started): the run's last checkpoint stands."""
    try:
        return run()
    except StopRequested as stop:
        print(f"stopped by {stop.name} at once", file=sys.stderr)
        return PREEMPTED_EXIT_CODE


def run_replicas(setup: TrainingSetup, api_job: ApiJob, on_tick) -> int:
    """In threads, or in the driver's processes; one device is a thread either way."""
    stopping = Stopping(setup.config.run.checkpoint_interval, setup.config.run.stop_timeout)
    if in_threads(setup):
        from app.launch.run import with_eager_threads  # noqa: PLC0415
        from app.parallel.threads import run_threads  # noqa: PLC0415
        api_job = dataclasses.replace(api_job, job=with_eager_threads(api_job.job))
        return run_threads(api_replica, api_job, setup.devices, setup.config.parallel,
                           stopping, on_tick)
    from app.parallel.launcher import launch  # noqa: PLC0415
    from app.parallel.plans import choose_sync  # noqa: PLC0415
    causes: list[str] = []
    code = launch(api_replica, api_job, setup.devices,
                  choose_sync(setup.config.parallel.sync, setup.devices, None),
                  setup.config.parallel, stopping, causes.append, on_tick=on_tick,
                  preload=api_inputs.modules_to_preload(api_job.parts))
    if causes:
        raise (UserError if code == 2 else RuntimeError)(f"{causes[0]}; stopped the others")
    return code


def in_threads(setup: TrainingSetup) -> bool:
    return setup.parallel == "threads" or len(setup.devices) == 1


def val_split(setup: TrainingSetup, val: Split | None) -> Split:
    train_set = setup.train_set
    if val is None:
        from app.catalog.dataset import Dataset  # noqa: PLC0415
        return Dataset(train_set.root).split("val", train_set.classes.wnids)
    if not isinstance(val, Split):
        raise UserError(f"val: got {type(val).__name__}; pass catalog.dataset(name)"
                        ".solutions(...) or .split(\"val\") with the train set's classes")
    if val.classes.wnids != train_set.classes.wnids or val.root.url != train_set.root.url:
        raise UserError(f"val: {val!r} does not have the classes of the train set "
                        f"{train_set!r}; pass the same classes= to both")
    return val


def resume_point(setup: TrainingSetup, resume: bool | str) -> str:
    """The checkpoint to continue from ("" for a fresh start)."""
    last = setup.run_dir / "checkpoints" / "last.pt"
    if resume not in (True, False, "auto"):
        raise UserError(f"resume={resume!r}: pass True, False or \"auto\"")
    if resume is True and not last.is_file():
        raise UserError(f"resume=True: {setup.run_dir} has no checkpoint yet; train without "
                        "resume (or resume=\"auto\")")
    if resume is False and last.is_file():
        raise UserError(f"{setup.run_dir} holds a run already: pass resume=True to continue "
                        "it, or call prepare_training again for a new run")
    return str(last) if last.is_file() else ""


def train_job(setup: TrainingSetup, config: Config, val: Split, resume_from: str) -> TrainJob:
    """The driver's TrainJob (app/launch/run.py prepare_job), from the setup's tables."""
    train_set = setup.train_set
    tables = Tables(train_set.frame, val.frame, list(train_set.classes.wnids),
                    list(train_set.classes.descriptions))
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, resume=resume_from))
    return TrainJob(config, train_set.root, tables,
                    resolution_of(config.data, config.data.image_size), str(setup.run_dir),
                    resume_from, resumed_run_id(resume_from) or new_run_id())

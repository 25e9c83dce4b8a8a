"""The training loop of one worker: batch -> forward -> backward -> GradientSync -> step.

Everything parallel hides behind `sync` (one call per step); everything about numerics behind
`precision`; saving and stopping on request behind `requests` (app/interrupts.py), polled once
per step. Metrics stay on the device and are fetched every print interval, not every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from app import preflight, run_state
from app.data.augment import EvalRecipe, TrainRecipe
from app.data.loader import build_loader
from app.data.sampler import ShardedBatches
from app.devices import WorkerEnv
from app.evaluate import evaluate
from app.interrupts import NoRequests, Requests
from app.job import TrainJob
from app.loggers import Logger
from app.models import create_model
from app.optim import build_optimizer, build_scheduler
from app.parallel import GradientSync
from app.precision import Precision
from app.run_state import Progress


@dataclass
class Parts:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    criterion: nn.Module
    precision: Precision
    train_batches: ShardedBatches
    train_loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    # This worker's sums over the current epoch: loss x images, images, skipped images.
    epoch_sums: torch.Tensor
    skipped: list = field(default_factory=list)  # (epoch, split, path, reason) not yet written


def build_parts(job: TrainJob, env: WorkerEnv) -> Parts:
    config = job.config
    torch.manual_seed(config.train.seed)  # identical initial weights on every replica
    precision = Precision.from_config(config.train.amp, config.train.channels_last, env.device,
                                      config.train.dtype)
    model = precision.prepare_model(create_model(config.model.arch, job.tables.num_classes,
                                                 config.model.norm))
    train_batches = ShardedBatches(len(job.tables.train), config.train.batch_size, rank=env.rank,
                                   world_size=env.world_size, seed=config.train.seed)
    val_batches = ShardedBatches(len(job.tables.val), config.train.batch_size, rank=env.rank,
                                 world_size=env.world_size, shuffle=False)
    optimizer = build_optimizer(model, config.optim, train_batches.global_batch)
    scheduler = build_scheduler(optimizer, config.optim, train_batches.steps_per_epoch(),
                                config.train.epochs)
    pin = precision.device.type == "cuda"
    workers = config.data.workers
    return Parts(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=precision.grad_scaler(),
        criterion=nn.CrossEntropyLoss(label_smoothing=config.optim.label_smoothing),
        precision=precision, train_batches=train_batches,
        train_loader=build_loader(job.root, job.tables.train, TrainRecipe(job.image_size),
                                  train_batches, workers, pin),
        val_loader=build_loader(job.root, job.tables.val, EvalRecipe(job.image_size),
                                val_batches, workers, pin),
        epoch_sums=torch.zeros(3, dtype=torch.float64, device=precision.device))


def train_worker(job: TrainJob, env: WorkerEnv, sync: GradientSync, logger: Logger,
                 requests: Requests | None = None) -> dict:
    """Train (or only evaluate) as configured; returns the last epoch's metrics, or
    {"stopped_at_step": N} when a stop was requested (a checkpoint was saved first)."""
    requests = requests or NoRequests()
    parts = build_parts(job, env)
    if env.is_primary and not job.config.run.evaluate:
        preflight.check_room_for_checkpoints(job, parts.model)
    progress = Progress()
    state = run_state.restore(parts, job.resume_from, progress, env) if job.resume_from else {}
    parts.model = sync.prepare(parts.model)
    if state:
        run_state.restore_replica(parts.model, state, env)
    if job.config.run.evaluate:
        metrics = evaluate(parts.model, parts.val_loader, parts.precision, sync)
        logger.log_metrics(progress.step, {"epoch": progress.epoch, **metrics})
        return metrics
    requests.poll(env.rank, progress.step)  # tells the driver this worker is training
    metrics: dict = {}
    for epoch in range(progress.epoch, job.config.train.epochs):
        started = time.perf_counter()
        if not train_one_epoch(parts, job, sync, env, progress, logger, requests):
            return {"stopped_at_step": progress.step}
        metrics = end_epoch(parts, job, sync, env, progress)
        metrics["epoch/time_s"] = time.perf_counter() - started
        logger.log_metrics(progress.step, metrics)
        every = job.config.logging.save_weights_every
        if every and progress.epoch % every == 0:
            logger.log_artifact(job.checkpoint_dir / "last.pt", f"weights-{job.run_id}", "model",
                                aliases=(f"epoch-{progress.epoch}",))
        run_state.check_bad_fraction(metrics, job)
    return metrics


def train_one_epoch(parts: Parts, job: TrainJob, sync: GradientSync, env: WorkerEnv,
                    progress: Progress, logger: Logger, requests: Requests) -> bool:
    """Train the rest of epoch `progress.epoch`; False when stopped on request."""
    parts.model.train()
    parts.train_batches.set_epoch(progress.epoch, start_step=progress.epoch_step)
    steps = parts.train_batches.steps_per_epoch()
    print_freq = job.config.train.print_freq
    interval = torch.zeros(2, dtype=torch.float64, device=parts.precision.device)
    tick = started = time.perf_counter()
    for batch in parts.train_loader:
        lr = parts.optimizer.param_groups[0]["lr"]  # the rate this step uses
        loss, weight = train_step(parts, batch, sync)
        progress.step += 1
        progress.epoch_step += 1
        interval[0] += loss * weight
        interval[1] += weight
        parts.epoch_sums[2] += len(batch.skipped)
        parts.skipped += [(progress.epoch + 1, "train", s.path, s.reason) for s in batch.skipped]
        if progress.epoch_step % print_freq == 0 or progress.epoch_step == steps:
            now = time.perf_counter()
            loss_sum, images = interval.tolist()
            parts.epoch_sums[:2] += interval
            logger.log_metrics(progress.step, {
                "epoch": progress.epoch + 1, "train/loss": loss_sum / max(images, 1),
                "train/lr": lr, "train/images_per_sec": images * env.world_size / (now - tick),
                "progress/epoch_step": progress.epoch_step, "progress/epoch_steps": steps,
                "progress/epoch_time_s": now - started})
            interval.zero_()
            tick = now
        action = requests.poll(env.rank, progress.step)
        if action.save:
            parts.epoch_sums[:2] += interval  # a checkpoint holds every image counted so far
            interval.zero_()
            run_state.save(parts, job, sync, env, progress)
        if action.stop:
            return False
    return True


def end_epoch(parts: Parts, job: TrainJob, sync: GradientSync, env: WorkerEnv,
              progress: Progress) -> dict:
    """Average BatchNorm statistics, evaluate, save: the epoch's metrics."""
    totals = sync.sum_across_workers(parts.epoch_sums).tolist()  # one reduction per epoch
    parts.epoch_sums.zero_()
    sync.average_buffers(parts.model)
    val_skipped: list = []
    metrics = evaluate(parts.model, parts.val_loader, parts.precision, sync, val_skipped)
    progress.epoch += 1
    progress.epoch_step = 0
    parts.skipped += [(progress.epoch, "val", s.path, s.reason) for s in val_skipped]
    metrics = {"epoch": progress.epoch, "train/epoch_loss": totals[0] / max(totals[1], 1),
               "train/images": int(totals[1]), "train/skipped": int(totals[2]), **metrics}
    run_state.save(parts, job, sync, env, progress, top1=metrics["val/top1"])
    return metrics


def train_step(parts: Parts, batch, sync: GradientSync) -> tuple[torch.Tensor, int]:
    """One optimizer step; returns the (device) mean loss of this worker's images and their
    count. The seam: gradients ready -> sync -> optimizer step."""
    weight = len(batch)
    loss = torch.zeros((), device=parts.precision.device)
    with sync.step(weight) as loss_scale:
        if weight:  # a worker without usable images still takes part in the sync
            images, labels = parts.precision.inputs(batch)
            with parts.precision.autocast():
                loss = parts.criterion(parts.model(images), labels)
            scaled = loss * loss_scale if loss_scale != 1.0 else loss
            (parts.scaler.scale(scaled) if parts.scaler else scaled).backward()
            loss = loss.detach()
    if sync.finish_step():  # every .grad is now the average over all workers' images
        if parts.scaler:
            parts.scaler.step(parts.optimizer)
            parts.scaler.update()
        else:
            parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()
    return loss.float(), weight

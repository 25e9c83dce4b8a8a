"""The training loop of one worker: batch -> forward -> backward -> GradientSync -> step.

Everything parallel hides behind `sync` (one call per step); everything about numerics behind
`precision`. Metrics stay on the device and are fetched every print interval, not every step.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from app import checkpoint
from app.data.augment import EvalRecipe, TrainRecipe
from app.data.loader import build_loader
from app.data.sampler import ShardedBatches
from app.devices import WorkerEnv
from app.evaluate import evaluate
from app.job import TrainJob
from app.loggers import Logger
from app.models import create_model
from app.optim import build_optimizer, build_scheduler, restore_scheduler
from app.parallel import GradientSync
from app.precision import Precision


@dataclass
class Progress:
    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    best_top1: float = -1.0


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
    skipped: list = field(default_factory=list)  # (epoch, path, reason) not yet reported


def build_parts(job: TrainJob, env: WorkerEnv, sync: GradientSync) -> Parts:
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
                                val_batches, workers, pin))


def train_worker(job: TrainJob, env: WorkerEnv, sync: GradientSync, logger: Logger) -> dict:
    """Train (or only evaluate) as configured; returns the last epoch's metrics."""
    parts = build_parts(job, env, sync)
    progress = Progress()
    if job.resume_from:
        restore(parts, job.resume_from, progress)
    parts.model = sync.prepare(parts.model)
    if job.config.run.evaluate:
        metrics = evaluate(parts.model, parts.val_loader, parts.precision, sync)
        logger.log_metrics(progress.step, {"epoch": progress.epoch, **metrics})
        return metrics
    metrics: dict = {}
    for epoch in range(progress.epoch, job.config.train.epochs):
        started = time.perf_counter()
        train_metrics = train_one_epoch(parts, job, sync, progress, logger)
        sync.average_buffers(parts.model)
        metrics = {**train_metrics, **evaluate(parts.model, parts.val_loader, parts.precision, sync)}
        progress.epoch = epoch + 1
        metrics = {"epoch": progress.epoch, **metrics,
                   "epoch/time_s": time.perf_counter() - started}
        skipped = sum(sync.gather(parts.skipped), [])
        parts.skipped.clear()
        if env.is_primary:
            save_checkpoints(parts, job, progress, metrics["val/top1"])
            write_skipped(job, skipped)
        logger.log_metrics(progress.step, metrics)
        every = job.config.logging.save_weights_every
        if every and progress.epoch % every == 0:
            logger.log_artifact(job.checkpoint_dir / "last.pt", f"weights-{job.run_id}", "model",
                                aliases=(f"epoch-{progress.epoch}",))
    return metrics


def train_one_epoch(parts: Parts, job: TrainJob, sync: GradientSync, progress: Progress,
                    logger: Logger) -> dict:
    parts.model.train()
    parts.train_batches.set_epoch(progress.epoch)
    steps = len(parts.train_batches)
    print_freq = job.config.train.print_freq
    device = parts.precision.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # stays on the device
    epoch_loss = torch.zeros((), dtype=torch.float64, device=device)
    images = epoch_images = skipped = 0
    tick = started = time.perf_counter()
    for index, batch in enumerate(parts.train_loader):
        lr = parts.optimizer.param_groups[0]["lr"]  # the rate this step uses
        loss, weight = train_step(parts, batch, sync)
        progress.step += 1
        loss_sum += loss * weight
        images += weight
        skipped += len(batch.skipped)
        parts.skipped += [(progress.epoch + 1, s.path, s.reason) for s in batch.skipped]
        if (index + 1) % print_freq == 0 or index + 1 == steps:
            now = time.perf_counter()
            epoch_loss += loss_sum
            epoch_images += images
            logger.log_metrics(progress.step, {
                "epoch": progress.epoch + 1, "train/loss": loss_sum.item() / max(images, 1),
                "train/lr": lr,
                "train/images_per_sec": images * parts.train_batches.world_size / (now - tick),
                "progress/epoch_step": index + 1, "progress/epoch_steps": steps,
                "progress/epoch_time_s": now - started})
            loss_sum.zero_()
            images, tick = 0, now
    # One reduction per epoch: loss sum, images and skipped images over all workers.
    totals = sync.sum_across_workers(torch.stack([
        epoch_loss, torch.tensor(epoch_images, dtype=torch.float64, device=device),
        torch.tensor(skipped, dtype=torch.float64, device=device)])).tolist()
    return {"train/epoch_loss": totals[0] / max(totals[1], 1), "train/images": int(totals[1]),
            "train/skipped": int(totals[2])}


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


def checkpoint_payload(parts: Parts, job: TrainJob, progress: Progress) -> dict:
    return {
        "model": checkpoint.unwrap(parts.model).state_dict(),
        "arch": job.config.model.arch, "num_classes": job.tables.num_classes,
        "optimizer": parts.optimizer.state_dict(), "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler else {},
        **asdict(progress), "config": job.config.to_dict(), "run_id": job.run_id,
        "rng": checkpoint.rng_states()}


def save_checkpoints(parts: Parts, job: TrainJob, progress: Progress, top1: float) -> None:
    """last.pt every epoch; best.pt when top-1 improves."""
    is_best = top1 > progress.best_top1
    if is_best:
        progress.best_top1 = top1
    payload = checkpoint_payload(parts, job, progress)
    checkpoint.save(job.checkpoint_dir / "last.pt", payload)
    if is_best:
        checkpoint.save(job.checkpoint_dir / "best.pt", payload)


def restore(parts: Parts, path: str, progress: Progress) -> None:
    state = checkpoint.load(path)
    checkpoint.load_model_weights(parts.model, state["model"], path)
    parts.optimizer.load_state_dict(state["optimizer"])
    restore_scheduler(parts.scheduler, state["scheduler"])
    if parts.scaler and state["scaler"]:
        parts.scaler.load_state_dict(state["scaler"])
    progress.epoch, progress.step = state["epoch"], state["step"]
    progress.best_top1 = state["best_top1"]
    checkpoint.set_rng_states(state["rng"])


def write_skipped(job: TrainJob, skipped: list[tuple[int, str, str]]) -> None:
    """Append this epoch's skipped images to runs/<run>/skipped.tsv (epoch, path, reason)."""
    if not skipped:
        return
    with open(Path(job.run_dir) / "skipped.tsv", "a", encoding="utf-8") as handle:
        handle.writelines(f"{epoch}\t{path}\t{reason}\n" for epoch, path, reason in skipped)

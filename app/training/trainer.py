"""One worker's training. The Trainer owns the worker's state (model, optimizer, LR schedule,
grad scaler, precision, input pipelines, position, epoch sums) and runs its loop; the model,
optimizer, schedule and loss come from `parts` (parts.py: the config's, or a Python caller's).

The loop reads top to bottom: fetch a batch, step, log every print_freq steps, poll for a
save/stop request. Everything parallel hides behind `sync` (app/parallel/__init__.py shows the
calls), numerics behind `precision`, stop and save requests behind `requests` (polled after
every step and every whole checkpoint: app/runtime/interrupts.py). Losses stay on the device and
are fetched once per print interval.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from app.catalog.skipped import SkippedLog, check_bad_fraction
from app.data.batch_augment import BatchAugment
from app.data.decoders import resolve_decoder
from app.data.pipeline import DeviceBatch
from app.loggers import Logger, NullLogger
from app.parallel.sync import GradientSync
from app.runtime.devices import WorkerEnv
from app.runtime.interrupts import NoRequests, Requests
from app.runtime.moments import moment
from app.training import checkpoint, preflight, run_state
from app.training.accumulation import Accumulation
from app.training.ema import build_ema
from app.training.evaluate import evaluate
from app.training.job import TrainJob
from app.training.losses import CheckedLoss
from app.training.optim import clip_gradients, restore_scheduler
from app.training.pace import INPUT_BOUND, Interval, Pace, input_bound_warning
from app.training.parts import ConfigParts, Parts, seeded_model
from app.training.precision import Precision
from app.training.progress import Finished, Outcome, Position, Stopped
from app.training.speed import (CompiledForFullBatches, compile_enabled, configure_backends,
                                report_compile_time)
from app.training.tally import Tally
from app.training.worker_pipelines import build_pipelines

log = logging.getLogger("imagenet_dp")


def train_worker(job: TrainJob, env: WorkerEnv, sync: GradientSync, logger: Logger,
                 requests: Requests | None = None, parts: Parts | None = None) -> Outcome:
    """Train (or only evaluate) as configured, continuing from job.resume_from if given;
    `parts`: the model, optimizer, schedule and loss (default: the config's)."""
    trainer = Trainer(job, env, sync, logger, requests or NoRequests(), parts)
    try:
        if job.resume_from:
            moment("worker:resuming")
            trainer.load_state_dict(run_state.load(job, env))
        return Finished(trainer.evaluate_and_log()) if job.config.run.evaluate else trainer.fit()
    except BaseException:
        trainer.close(at_once=True)  # a failure ends this worker, and the run, without delay
        raise
    finally:
        trainer.close()


class Trainer:
    def __init__(self, job: TrainJob, env: WorkerEnv, sync: GradientSync,
                 logger: Logger | None = None, requests: Requests | None = None,
                 parts: Parts | None = None):
        config, parts = job.config, parts or ConfigParts()
        self.job, self.env, self.sync = job, env, sync
        self.logger, self.requests = logger or NullLogger(), requests or NoRequests()
        self.precision = Precision.from_config(config.train.amp, config.train.channels_last,
                                               env.device, config.train.dtype)
        configure_backends(self.precision.device, config.train.cudnn_benchmark, config.train.tf32)
        moment("worker:building-model")
        model = self.precision.prepare_model(seeded_model(parts, job, config.train.seed))
        self.train_data, self.val_data = build_pipelines(job, env, self.precision)
        self.accumulation = Accumulation(config.train.accum_steps,
                                         self.train_data.steps_per_epoch())
        self.scaler = self.precision.grad_scaler()
        global_batch = config.train.batch_size * env.world_size * config.train.accum_steps
        self.optimizer = parts.optimizer(model, job, global_batch, fused=self.precision.fused_step)
        self.scheduler = parts.scheduler(self.optimizer, job, self.accumulation.steps_per_epoch)
        self.ema = build_ema(model, config.train.model_ema or config.run.use_ema,
                             config.train.model_ema_decay, config.train.model_ema_steps,
                             global_batch, config.train.epochs, config.optim.warmup_epochs,
                             self.accumulation.steps_per_epoch)
        # Takes class indices, or the probability rows that mixup/cutmix make (smoothed alike).
        self.criterion = CheckedLoss(parts.criterion(job), job.tables.num_classes)
        self.batch_augment = BatchAugment.from_config(config.augment, job.tables.num_classes,
                                                      config.train.seed, env.rank, env.world_size)
        self.position, self.best_top1 = Position(), -1.0
        self.epoch_sums = Tally(self.precision.device)
        self.interval = Tally(self.precision.device)
        self.pace = Pace()
        self.steps_this_epoch = 0  # optimizer steps of the current epoch this session trained
        self.skipped = SkippedLog(job.run_dir)
        if env.is_primary and not config.run.evaluate:
            preflight.check_room_for_checkpoints(job, model)
        self.model = sync.prepare(model, self.ema.module if self.ema else None)
        self.compiling = compile_enabled(config.train.compile, self.precision.device)
        self.compiled_sizes: set[int] = set()  # train sizes whose first step was reported
        if self.compiling:  # after prepare: torch.compile wraps DDP, not the other way round
            sizes = len(job.resolution.train.distinct(config.train.epochs)) + 1  # + val
            self.model = CompiledForFullBatches(self.model, config.train.batch_size,
                                                config.train.compile_backend, sizes)

    # --- state: what a checkpoint holds (run_state.py writes and reads it) ----------------------

    def state_dict(self) -> dict:
        bare = checkpoint.unwrap(self.model)
        return {
            "model": bare.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else {},
            "ema": self.ema.state_dict() if self.ema else None,
            "epoch": self.position.epoch, "epoch_step": self.position.epoch_step,
            "step": self.position.step, "best_top1": self.best_top1,
            # this worker's share, the print interval's images too (left in it: its own rate)
            "epoch_sums": self.epoch_sums.as_tensor() + self.interval.as_tensor(),
            "replica": {"buffers": run_state.replica_buffers(self.replica_models()),
                        "rng": checkpoint.rng_states(self.precision.device)},
        }

    def load_state_dict(self, state: dict) -> None:
        checkpoint.load_model_weights(self.model, state["model"], self.job.resume_from)
        self.optimizer.load_state_dict(state["optimizer"])
        restore_scheduler(self.scheduler, state["scheduler"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.position = Position(state["epoch"], state["epoch_step"], state["step"])
        self.best_top1 = state["best_top1"]
        if "epoch_sums" in state:
            self.epoch_sums.load(state["epoch_sums"])
        if self.ema:
            run_state.load_ema(self.ema, state, self.job.resume_from, self.job.config.run.use_ema)
        if replica := state.get("replica"):
            run_state.restore_replica_buffers(self.replica_models(), replica["buffers"])
            checkpoint.set_rng_states(replica["rng"], self.precision.device)

    def replica_models(self) -> dict[str, torch.nn.Module]:
        """The models whose BatchNorm statistics each replica keeps, by key prefix."""
        models = {"": checkpoint.unwrap(self.model)}
        if self.ema:
            models["ema."] = self.ema.module
        return models

    def save(self, top1: float | None = None) -> Path | None:
        """Collective: all workers call it at one step; returns the path on the primary."""
        best = top1 is not None and top1 > self.best_top1
        if best:
            self.best_top1 = top1
        return run_state.save(self.state_dict(), self.sync, self.env, self.job, best)

    # --- the loop --------------------------------------------------------------------------

    def fit(self) -> Outcome:
        self.open_pipelines()
        moment("worker:first-batch")
        # The start is a checkpointed point: a stop asked for by now trains nothing, and the
        # checkpoint this worker resumed from (if any) stands.
        if self.requests.checkpointed(self.env.rank, self.position.step).stop:
            return Stopped(self.position.step)
        metrics: dict | None = {}
        while self.position.epoch < self.job.config.train.epochs:
            whole = self.position.epoch_step == 0  # not resumed in its middle
            if not self.train_epoch():
                return Stopped(self.position.step)
            metrics = self.end_epoch(whole)
            if metrics is None or self.requests.checkpointed(self.env.rank,
                                                             self.position.step).stop:
                return Stopped(self.position.step)
        return Finished(metrics)

    def open_pipelines(self) -> None:
        """Both pipelines take what they hold for the run now, where they will first be asked
        for: out of memory then ends the run before its first step, not at the first evaluation,
        after training has grown torch's allocator."""
        if self.position.epoch < self.job.config.train.epochs:
            moment("worker:starting-loaders")
            self.train_data.open(self.position.epoch,
                                 self.accumulation.first_batch(self.position.epoch_step))
            self.val_data.open(0)

    def train_epoch(self) -> bool:
        """Train the rest of the current epoch; False when stopped on request."""
        self.model.train()
        epoch, print_freq = self.position.epoch, self.job.config.train.print_freq
        steps = self.accumulation.steps_per_epoch
        size = self.job.resolution.train.at(epoch)
        self.pace.start_epoch()
        self.steps_this_epoch = 0
        for batch, micro, last in self.pace.batches(self.accumulation.epoch(
                self.train_data, epoch, self.position.epoch_step)):
            self.lr = lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
            step_started = time.perf_counter()
            loss = self.train_step(batch, micro, last)
            if (self.compiling and size not in self.compiled_sizes
                    and len(batch) == self.job.config.train.batch_size):
                self.compiled_sizes.add(size)  # recorded at the step this batch belongs to
                report_compile_time(step_started, self.precision.device, size, self.logger,
                                    self.position.step + 1)
            self.interval.add(loss, len(batch), len(batch.skipped))
            self.skipped.add(epoch + 1, "train", batch.skipped)
            if not last:  # saves, stops and logs only between optimizer steps
                continue
            self.position.step += 1
            self.position.epoch_step += 1
            self.steps_this_epoch += 1
            if self.ema:
                self.ema.after_step(self.position.epoch_step - 1, self.position.step)
            if self.position.epoch_step % print_freq == 0 or self.position.epoch_step == steps:
                self.log_interval(lr, self.pace.end_interval())
            moment(f"worker:step-{self.position.step}")
            action = self.requests.poll(self.env.rank, self.position.step)
            if action.ended:  # the last whole checkpoint stands, as the driver said
                return False
            if action.save or action.stop:  # a trained point: the save holds this step
                self.save()
                if action.stop or self.requests.checkpointed(self.env.rank,
                                                             self.position.step).stop:
                    return False
        return True

    def train_step(self, batch: DeviceBatch, micro: int = 0, last: bool = True
                   ) -> torch.Tensor | None:
        """Micro-batch `micro` of an optimizer step, the step itself after its `last`; returns
        this worker's mean loss (on the device; None without images). The seam: gradients
        ready -> sync -> optimizer step."""
        images = len(batch)
        loss = None
        with self.sync.step(images, last) as loss_scale:
            if images:  # a worker without usable images still takes part in the sync
                index = self.accumulation.first_batch(self.position.epoch_step) + micro
                inputs, targets = self.batch_augment(batch.images, batch.labels, index,
                                                     self.position.epoch)  # seeded by its place
                with self.precision.autocast():
                    loss = self.criterion(self.model(inputs), targets)
                scaled = loss * loss_scale if loss_scale != 1.0 else loss
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        if last:
            self.optimizer_step()
        return loss.detach() if loss is not None else None

    def optimizer_step(self) -> None:
        if self.sync.finish_step():  # every .grad is now the average over all workers' images
            clip_gradients(self.optimizer, self.job.config.optim.clip_grad_norm, self.scaler)
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def log_interval(self, lr: float, interval: Interval) -> None:
        """The print interval's mean loss: the one device->host copy of the interval."""
        images = self.interval.images
        loss = self.interval.loss_sum.item() / max(images, 1)
        self.interval.move_into(self.epoch_sums)
        self.logger.log_metrics(self.position.step, {
            "epoch": self.position.epoch + 1, "train/loss": loss, "train/lr": lr,
            "train/images_per_sec": images * self.env.world_size / interval.seconds,
            "train/data_wait": interval.data_wait,
            "progress/epoch_step": self.position.epoch_step,
            "progress/epoch_steps": self.accumulation.steps_per_epoch,
            "progress/epoch_time_s": interval.epoch_seconds})

    def end_epoch(self, whole: bool) -> dict | None:
        """Average BatchNorm statistics, evaluate, save and log: the epoch's metrics. None: a
        stop request came during the evaluation, which was left off; the epoch's trained steps
        are saved unevaluated (a resume evaluates them)."""
        data_wait = self.pace.epoch_data_wait()  # of the training, before the evaluation
        trained_s = self.pace.epoch_seconds()  # a resumed epoch: since the resume
        if self.env.is_primary and data_wait > INPUT_BOUND:
            data = self.job.config.data
            log.warning(input_bound_warning(self.position.epoch + 1, data_wait, data.workers,
                                            resolve_decoder(data.decoder, self.precision.device)))
        for model in self.replica_models().values():
            self.sync.average_buffers(model)
        val = self.evaluate(should_stop=self.requests.stop_pending)
        if val is not None and self.ema:  # the same images: counts and skips are the raw pass's
            ema = self.evaluate(self.ema.module, record_skipped=False,
                                should_stop=self.requests.stop_pending)
            val = None if ema is None else val | {
                f"val_ema/{key}": ema[f"val/{key}"] for key in ("top1", "top5", "loss")}
        if val is None:
            self.save()
            return None
        self.interval.move_into(self.epoch_sums)
        loss_sum, images, skipped = self.sync.sum_across_workers(
            self.epoch_sums.as_tensor()).tolist()  # one reduction per epoch
        self.epoch_sums = Tally(self.precision.device)
        self.position = Position(self.position.epoch + 1, 0, self.position.step)
        metrics = {"epoch": self.position.epoch, "train/epoch_loss": loss_sum / max(images, 1),
                   "train/images": int(images), "train/skipped": int(skipped),
                   "train/epoch_lr": getattr(self, "lr", 0.0),  # its last step's
                   "train/image_size": self.job.resolution.train.at(self.position.epoch - 1), **val}
        if self.steps_this_epoch:  # a resume at the epoch's end trained none of it here
            metrics["train/epoch_images_per_sec"] = images / trained_s
        path = self.save(top1=self.best_of(metrics))
        metrics |= {"epoch/time_s": self.pace.end_epoch(whole), "epoch/data_wait": data_wait}
        left = self.pace.remaining_s(self.job.config.train.epochs - self.position.epoch)
        if left is not None:
            metrics["run/remaining_s"] = left
        self.logger.log_metrics(self.position.step, metrics)
        if self.job.uploads and self.env.is_primary:  # the record with the epoch's row
            self.job.uploads.record()
        every = self.job.config.logging.save_weights_every
        if path and every and self.position.epoch % every == 0:
            self.logger.log_artifact(path, f"weights-{self.job.run_id}", "model",
                                     aliases=(f"epoch-{self.position.epoch}",))
        check_bad_fraction(metrics, self.job.config.data.max_bad_fraction, self.job.run_dir)
        return metrics

    def best_of(self, metrics: dict) -> float:
        """The top-1 that decides best.pt: the better of the raw and the EMA weights."""
        top1, ema_top1 = metrics["val/top1"], metrics.get("val_ema/top1", float("nan"))
        if ema_top1 > top1:  # False for NaN: no EMA, or no val image
            if self.env.is_primary and ema_top1 > self.best_top1:
                log.info("epoch %d: the EMA weights rate best (top-1 %.4f, raw %.4f); best.pt "
                         "ranks by them", self.position.epoch, ema_top1, top1)
            return ema_top1
        return top1

    def evaluate(self, model: torch.nn.Module | None = None, record_skipped: bool = True,
                 should_stop=lambda: False) -> dict | None:
        """The val metrics of the trained model, or of `model` (the EMA's); None where a stop
        request (`should_stop`) left it off."""
        epoch = self.position.epoch + 1  # the epoch this evaluation ends
        return evaluate(model or self.model, self.val_data.epoch(0), self.precision, self.sync,
                        on_skipped=(lambda images: self.skipped.add(epoch, "val", images))
                        if record_skipped else None,
                        flip_tta=self.job.config.augment.val_flip_tta, should_stop=should_stop)

    def evaluate_and_log(self) -> dict:
        if self.job.config.run.use_ema:
            log.info("evaluating the EMA weights of %s", self.job.resume_from)
        metrics = self.evaluate(self.ema.module if self.job.config.run.use_ema else None)
        self.logger.log_metrics(self.position.step, {"epoch": self.position.epoch, **metrics})
        return metrics

    def close(self, at_once: bool = False) -> None:
        self.train_data.close(at_once)
        self.val_data.close(at_once)

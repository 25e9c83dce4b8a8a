"""A worker's two input pipelines, built from the job: its recipes, this worker's share of the
batches and the configured decoder; with --log-samples the train pipeline records its batches."""

from __future__ import annotations

from app.data.augment import EvalRecipe, TrainRecipe
from app.data.decoders import build_pipeline
from app.data.pipeline import InputFormat, InputPipeline, PipelineSpec
from app.data.windows import DEFAULT_WINDOW, batches_for
from app.runtime.devices import WorkerEnv
from app.training.job import TrainJob
from app.training.precision import Precision
from app.training.sample_log import RecordedPipeline


def build_pipelines(job: TrainJob, env: WorkerEnv, precision: Precision
                    ) -> tuple[InputPipeline, InputPipeline]:
    """This worker's train and val pipelines, with the decoder the config names."""
    config = job.config
    form = InputFormat(precision.device, precision.input_dtype, precision.channels_last,
                       tuple(config.data.mean), tuple(config.data.std))
    batch_size, workers = config.train.batch_size, config.data.workers
    augment = config.augment  # --ra-reps counts only with --ra-sampler, as in torchvision
    repetitions = augment.ra_reps if augment.ra_sampler else 1
    recipe = TrainRecipe.for_sizes(job.resolution.train, auto_augment=augment.auto_augment,
                                   ra_magnitude=augment.ra_magnitude,
                                   scale=(augment.crop_min_scale, 1.0),
                                   crop=augment.train_crop)
    window = job.root.options.get("window", DEFAULT_WINDOW)  # shard layouts only
    train = PipelineSpec(job.root, job.tables.train, recipe,
                         batches_for(job.tables.train, batch_size, window, rank=env.rank,
                                     world_size=env.world_size, seed=config.train.seed,
                                     repetitions=repetitions),
                         workers, form)
    sizes = job.resolution
    val = PipelineSpec(job.root, job.tables.val, EvalRecipe(sizes.val_crop,
                                                            sizes.val_crop_fraction),
                       batches_for(job.tables.val, batch_size, window, rank=env.rank,
                                   world_size=env.world_size, shuffle=False),
                       workers, form)
    options = {"hw_decoder_load": config.data.hw_decoder_load}
    trained = build_pipeline(config.data.decoder, train, **options)
    if config.logging.log_samples:  # --log-samples: samples/rank-R.jsonl
        trained = RecordedPipeline(trained, train.batches, job.run_dir, env)
    return trained, build_pipeline(config.data.decoder, val, **options)

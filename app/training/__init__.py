"""Training one worker: the TrainJob every worker receives (job), the Trainer and its loop
(trainer), evaluation, the worker's input pipelines (worker_pipelines) and the record of what
they handed over (sample_log), optimizers and schedules (optim), losses, EMA, gradient
accumulation, precision and compilation (precision, speed), the per-epoch tally, checkpoints and
the state a resume restores (checkpoint, run_state; on another number of workers: batch_layout),
and the checks before a run starts (preflight).

Imports app.runtime, app.config, app.catalog, app.data, app.parallel, app.loggers and app.models;
nothing above. No face: the modules import torch and timm, and are used one by one.
"""

"""Training one worker: the TrainJob every worker receives (job), the Trainer and its loop
(trainer), evaluation, input pipelines (worker_pipelines, sample_log), optimizers and schedules
(optim), losses, EMA, gradient accumulation, precision and compilation (precision, speed), the
per-epoch tally, checkpoints and resumes (checkpoint, run_state, batch_layout), and the checks
before a run starts (preflight).

Imports app.runtime, app.config, app.catalog, app.data, app.parallel, app.loggers and app.models;
nothing above. No face: the modules import torch and timm, and are used one by one.
"""

"""Starting a training run: run (config -> TrainJob -> the worker processes, under the driver,
torchrun or srun, with restarts) and worker (one worker process: peers, loggers, the Trainer).

Imports every package below it (runtime, config, catalog, data, parallel, loggers, models,
training); nothing above.
"""

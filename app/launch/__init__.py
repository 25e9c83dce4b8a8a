"""Starting a training run: run (config -> TrainJob -> the worker processes, under the driver,
torchrun, srun or mpirun, with restarts), worker (one worker, a process or a thread: peers,
loggers, the Trainer) and the Python API behind `import app` (python_api: open_catalog,
prepare_training, train; api_inputs: its arguments checked as the CLI checks flags).

Imports every package below it (runtime, config, catalog, data, parallel, loggers, models,
training); nothing above.
"""

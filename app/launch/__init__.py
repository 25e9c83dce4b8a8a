"""Starting a training run: run (config -> TrainJob -> the worker processes, under the driver,
torchrun, srun or mpirun, with restarts), worker (one worker, a process or a thread), and the
Python API behind `import app` (python_api, with its arguments checked in api_inputs).

Imports every package below it (runtime, config, catalog, data, parallel, loggers, models,
training); nothing above.
"""

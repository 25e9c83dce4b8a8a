"""The ground floor: what this process is, what it has been asked, and how it ends.

errors (UserError: a user's mistake as one line, exit code 2), cli (how every bin/ script ends),
files (atomic writes), devices (WorkerEnv, and LaunchEnv from torchrun's, an MPI launcher's or
Slurm's environment, parsed by mpi and slurm), interrupts (stop and save requests from signals),
forkserver and spawning (where a run's processes start). Imports no other package of app/.
"""

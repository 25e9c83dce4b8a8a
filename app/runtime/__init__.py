"""The ground floor: what this process is, what it has been asked, and how it ends.

errors (UserError: a user's mistake as one line, exit code 2), cli (how every bin/ script turns
that into its exit, and ends without the slow teardown), files (atomic writes), devices
(WorkerEnv, and LaunchEnv: rank and world read from torchrun's, an MPI launcher's or Slurm's
environment; mpi and slurm parse the latter two), interrupts (stop and save requests from
signals), spawning (spawned processes from a script read from standard input). Imports no
other package of app/.
"""

"""The ground floor: what this process is, what it has been asked, and how it ends.

errors (UserError: a user's mistake as one line, exit code 2), cli (how every bin/ script turns
that into its exit), files (atomic writes), devices (WorkerEnv, and LaunchEnv: rank and world
read from torchrun's or Slurm's environment; slurm parses the latter), interrupts (stop and save
requests from signals). Imports no other package of app/.
"""

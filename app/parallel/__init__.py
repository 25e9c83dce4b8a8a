"""How replicas agree: the GradientSync interface (sync.py). The training loop calls it around
each backward and once before the optimizer step:

    with sync.step(weight) as loss_scale:      # weight = images this worker has in the step
        (loss * loss_scale).backward()          # buckets may leave while backward runs
    total = sync.finish_step()                  # .grad now holds the weighted average
    if total: optimizer.step()                  # total = images over all workers (0: skip)

With gradient accumulation every micro-batch but a step's last calls `step(weight, last=False)`
and the last exchanges the summed .grad, once. Implementations: LocalSync (sync.py),
ParameterServerSync (ps_worker.py), AllReduceSync (allreduce.py). Averages are weighted by
image counts, so N workers x batch b compute exactly what one worker with batch N*b would.

This face imports nothing, so the driver reads the sync modes (plans.py) and runs the
supervisor (launcher.py) without torch. Imports only app.runtime and app.config.
"""

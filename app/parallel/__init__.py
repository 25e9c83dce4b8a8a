"""How replicas agree: the GradientSync interface. The training loop calls it around each
backward and once before the optimizer step:

    with sync.step(weight) as loss_scale:      # weight = images this worker has in the step
        (loss * loss_scale).backward()          # buckets may leave while backward runs
    total = sync.finish_step()                  # .grad now holds the weighted average
    if total: optimizer.step()                  # total = images over all workers (0: skip)

Gradient accumulation: an optimizer step of several micro-batches calls `step(weight,
last=False)` for all but its last micro-batch; their gradients add up in .grad, and only the
last one (`last=True`) exchanges them, once, before finish_step().

Implementations: LocalSync (one worker), ParameterServerSync (app/parallel/ps_worker.py) and
AllReduceSync (app/parallel/allreduce.py). The loop never needs to know which one it has.
Averages are weighted by image counts, so N workers x batch b compute exactly what one worker
with batch N*b would, short last batches and skipped images included.

The interface and LocalSync live in app/parallel/sync.py. This face imports nothing: the
driver reads the sync modes (plans.py) and runs the supervisor (launcher.py) without torch,
which only the processes it starts import.

Imports only app.runtime and app.config: the supervisor and the sync modes know nothing of
the model factory, the loop or the loggers.
"""

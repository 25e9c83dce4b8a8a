"""What a run says as it ends on request: where its checkpoint stands (locally, or in its
bucket) and the command that continues it."""

from __future__ import annotations

import shlex
import sys

from app.catalog.uploader import Mirrored
from app.launch import remote_output
from app.training.job import TrainJob


def resume_hint(job: TrainJob, mirrored: Mirrored | None = None) -> str:
    """After a stop on request: where the checkpoint is and the command that continues (for a
    run folder in a bucket: the bucket's last.pt, or the local copy its upload left)."""
    from app.training import checkpoint  # noqa: PLC0415
    last = job.checkpoint_dir / "last.pt"
    if not last.is_file():
        command = shlex.join(["python", *continuing_argv(sys.argv, job.config.run.name)])
        return f"no checkpoint of this run yet (no step of it is saved); to start it again: " \
               f"{command}"
    state = checkpoint.load(last, mmap=True)
    where, resume = str(last), "auto"
    if job.output_store:
        where, resume = remote_output.stop_hint(job.output_store, last, mirrored)
    command = shlex.join(["python", *continuing_argv(sys.argv, job.config.run.name, resume)])
    return f"saved {where} {position(state)}; to continue: {command}"


def continuing_argv(argv: list[str], run_name: str, resume: str = "auto") -> list[str]:
    """`argv` with its own --resume and --run-name (either spelling) replaced by the pair that
    continues this run, so a resumed run's hint does not repeat them."""
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in ("--resume", "--run-name"):
            skip = True
        elif not word.startswith(("--resume=", "--run-name=")):
            kept.append(word)
    return [*kept, "--resume", resume, "--run-name", run_name]


def position(state: dict) -> str:
    """Where a checkpoint stands, in words."""
    return (f"after step {state['step']} ({state['epoch_step']} steps into epoch "
            f"{state['epoch'] + 1})")

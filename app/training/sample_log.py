"""--log-samples: which images each worker trained on, batch by batch, in the run folder.

Off by default. When on, every worker appends to samples/rank-<r>.jsonl one line per train
batch (micro-batch) as it hands the batch to the loop:

    {"time": ..., "epoch": 1, "offset": 96, "rank": 1, "world_size": 2, "samples": [17, 3, ...]}

`samples` are the rows of the train table the batch was made of, `offset` the position of its
global batch (all workers' images of that pipeline step) in the epoch's global order: a number
that means the same whatever the number of workers. Each start, fresh or resumed, first writes
{"event": "start", "epoch": e, "offset": o, "time": t}: a run that went on from a checkpoint
repeats what an earlier attempt trained after it (a killed run restarted), and only the later
attempt's batches count (`trained_samples`). A start's time is taken when the worker builds
its pipelines, before its first exchange with the other workers (the Trainer connects its
model to them afterwards), so it is earlier than any batch of its own start and later than
every batch of the starts before. Lines are flushed as written, so a killed worker's record
ends where it stopped. Cost: one short line per batch and worker.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import IO, Iterator

from app.data.pipeline import DeviceBatch, InputPipeline
from app.data.sampler import ShardedBatches
from app.runtime.devices import WorkerEnv

FOLDER = "samples"


class RecordedPipeline:
    """A train pipeline that records each batch it hands over. The batch's rows come from
    the same pure function of (seed, epoch, step, rank) the pipeline's readers use."""

    def __init__(self, pipeline: InputPipeline, batches: ShardedBatches, run_dir: str,
                 env: WorkerEnv):
        self.pipeline, self.batches, self.env = pipeline, batches, env
        folder = Path(run_dir) / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        self.file: IO[str] | None = open(folder / f"rank-{env.rank}.jsonl", "a")
        self.started = time.time()  # before any worker of this start trains (module docstring)

    def open(self, epoch: int, start_step: int = 0) -> None:
        """Where this start goes on from: the training starts here."""
        self.write({"event": "start", "epoch": epoch + 1, "offset": self.offset(start_step),
                    "time": self.started})
        self.pipeline.open(epoch, start_step)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[DeviceBatch]:
        order = self.batches.order(epoch)
        for step, batch in enumerate(self.pipeline.epoch(epoch, start_step), start_step):
            rows = [row for row, _ in self.batches.items(order, epoch, step)]
            self.write({"epoch": epoch + 1, "offset": self.offset(step), "rank": self.env.rank,
                        "world_size": self.env.world_size, "samples": rows})
            yield batch

    def offset(self, step: int) -> int:
        return step * self.batches.global_batch

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps({"time": time.time(), **record}) + "\n")
            self.file.flush()

    def steps_per_epoch(self) -> int:
        return self.pipeline.steps_per_epoch()

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
        self.pipeline.close()


def trained_samples(run_dir: str | Path) -> dict[int, list[int]]:
    """Epoch (from 1) -> the train rows its batches were made of, over every worker and every
    start of the run. A batch recorded before a later start that went on from an earlier
    place (same epoch and a lower or equal offset, or an earlier epoch) does not count: the
    later start trained that place again."""
    lines = [json.loads(line) for path in sorted((Path(run_dir) / FOLDER).glob("rank-*.jsonl"))
             for line in path.read_text().splitlines()]
    starts = [r for r in lines if r.get("event") == "start"]
    samples: dict[int, list[int]] = defaultdict(list)
    for record in lines:
        if record.get("event"):
            continue
        place = (record["epoch"], record["offset"])
        if any(s["time"] > record["time"] and (s["epoch"], s["offset"]) <= place
               for s in starts):
            continue
        samples[record["epoch"]].extend(record["samples"])
    return dict(samples)

"""--log-samples: which images each worker trained on, batch by batch, in the run folder.

Every worker appends to samples/rank-<r>.jsonl one line per train (micro-)batch as it hands the
batch to the loop:

    {"time": ..., "start": 2, "epoch": 1, "offset": 96, "rank": 1, "world_size": 2,
     "samples": [17, 3, ...]}

`samples` are train table rows, `offset` the place of the batch's global batch in the epoch's
global order (the same whatever the number of workers), `start` numbers the run's starts; each
start first writes {"event": "start", "start": n, "epoch": e, "offset": o}.

The workers of a start agree on its number without talking (clocks may differ by more than a
step): each counts the lines of samples/starts.jsonl when it builds its pipelines, before its
first exchange with the others (connecting the model is a barrier in every sync mode), and the
primary appends this start's line only when training starts, after that exchange.
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
STARTS = "starts.jsonl"  # one line per start, by the primary: how starts are numbered


class RecordedPipeline:
    """A train pipeline that records each batch it hands over. The batch's rows come from
    the same pure function of (seed, epoch, step, rank) the pipeline's readers use."""

    def __init__(self, pipeline: InputPipeline, batches: ShardedBatches, run_dir: str,
                 env: WorkerEnv):
        self.pipeline, self.batches, self.env = pipeline, batches, env
        self.folder = Path(run_dir) / FOLDER
        self.folder.mkdir(parents=True, exist_ok=True)
        self.start = len(read_lines(self.folder / STARTS)) + 1  # see the module docstring
        self.file: IO[str] | None = open(self.folder / f"rank-{env.rank}.jsonl", "a")

    def open(self, epoch: int, start_step: int = 0) -> None:
        """Where this start goes on from: the training starts here."""
        start = {"event": "start", "start": self.start, "epoch": epoch + 1,
                 "offset": self.offset(start_step)}
        if self.env.is_primary:
            with open(self.folder / STARTS, "a") as starts:
                starts.write(json.dumps({**start, "world_size": self.env.world_size}) + "\n")
        self.write(start)
        self.pipeline.open(epoch, start_step)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[DeviceBatch]:
        order = self.batches.order(epoch)
        for step, batch in enumerate(self.pipeline.epoch(epoch, start_step), start_step):
            rows = [row for row, _ in self.batches.items(order, epoch, step)]
            self.write({"start": self.start, "epoch": epoch + 1, "offset": self.offset(step),
                        "rank": self.env.rank, "world_size": self.env.world_size,
                        "samples": rows})
            yield batch

    def offset(self, step: int) -> int:
        return step * self.batches.global_batch

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps({"time": time.time(), **record}) + "\n")
            self.file.flush()

    def steps_per_epoch(self) -> int:
        return self.pipeline.steps_per_epoch()

    def close(self, at_once: bool = False) -> None:
        if self.file:
            self.file.close()
            self.file = None
        self.pipeline.close(at_once)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def records(run_dir: str | Path) -> list[dict]:
    """Every line of every worker's record, file by file (rank 0 first), each in order."""
    return [record for path in sorted((Path(run_dir) / FOLDER).glob("rank-*.jsonl"))
            for record in read_lines(path)]


def trained_samples(run_dir: str | Path) -> dict[int, list[int]]:
    """Epoch (from 1) -> the train rows its batches were made of, over every worker and start.
    A batch that a later start went on from an earlier place of (same epoch and a lower or equal
    offset, or an earlier epoch) does not count: the later start trained that place again."""
    lines = records(run_dir)
    starts = [r for r in lines if r.get("event") == "start"]
    samples: dict[int, list[int]] = defaultdict(list)
    for record in lines:
        if record.get("event"):
            continue
        place = (record["epoch"], record["offset"])
        if any(s["start"] > record["start"] and (s["epoch"], s["offset"]) <= place
               for s in starts):
            continue
        samples[record["epoch"]].extend(record["samples"])
    return dict(samples)

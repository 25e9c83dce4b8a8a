"""The loop's clock, in host time only (nothing here waits for the device): how long each print
interval and epoch took, the share of it spent waiting for the next batch (the time `next()`
on the epoch's batches takes: pytorch/examples' "Data" seconds, as a share, whatever the batch
size; one that stays high means the GPU idles for want of images), and the time left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, TypeVar

Item = TypeVar("Item")
INPUT_BOUND = 0.10  # an epoch waiting longer than this share of its time is worth a warning


@dataclass(frozen=True)
class Interval:
    seconds: float  # since the previous interval ended (or the epoch began)
    data_wait: float  # the share of them spent waiting for batches, in [0, 1]
    epoch_seconds: float  # since the epoch began


class Pace:
    def __init__(self) -> None:
        self.start_epoch()
        self.whole_epochs: list[float] = []  # seconds of this session's whole epochs

    def start_epoch(self) -> None:
        self.epoch_started = self.interval_started = time.perf_counter()
        self.epoch_waited = self.interval_waited = 0.0

    def batches(self, items: Iterable[Item]) -> Iterator[Item]:
        """`items`, the time each took to come counted as waiting."""
        iterator = iter(items)
        asked = time.perf_counter()
        for item in iterator:
            waited = time.perf_counter() - asked
            self.interval_waited += waited
            self.epoch_waited += waited
            yield item
            asked = time.perf_counter()

    def end_interval(self) -> Interval:
        """The interval that ends now; the next one starts."""
        now = time.perf_counter()
        seconds = now - self.interval_started
        interval = Interval(seconds, share(self.interval_waited, seconds),
                            now - self.epoch_started)
        self.interval_started, self.interval_waited = now, 0.0
        return interval

    def epoch_seconds(self) -> float:
        """Seconds since the epoch began (a resumed epoch: since the resume)."""
        return time.perf_counter() - self.epoch_started

    def epoch_data_wait(self) -> float:
        """The share of the epoch's training so far spent waiting for batches."""
        return share(self.epoch_waited, self.epoch_seconds())

    def end_epoch(self, whole: bool) -> float:
        """Seconds since the epoch began, evaluation and saving included; a `whole` epoch (not
        one resumed in its middle) counts towards the time left."""
        seconds = time.perf_counter() - self.epoch_started
        if whole:
            self.whole_epochs.append(seconds)
        return seconds

    def remaining_s(self, epochs_left: int) -> float | None:
        """Epochs left x the mean whole epoch of this session; None before one was timed."""
        if not self.whole_epochs:
            return None
        return epochs_left * sum(self.whole_epochs) / len(self.whole_epochs)


def share(part: float, whole: float) -> float:
    return min(1.0, part / whole) if whole > 0 else 0.0


def input_bound_warning(epoch: int, data_wait: float, workers: int, decoder: str) -> str:
    """What an epoch that waited for more than INPUT_BOUND of its time says, and the knobs."""
    return (f"epoch {epoch}: waited for batches {data_wait:.0%} of its training time "
            f"(input-bound); what feeds it faster: more loader processes (-j, now {workers}), "
            f"a GPU decoder (--decoder, now {decoder}), a local cache of the dataset "
            "(cache_dir in datasets.toml)")

"""Top-1/top-5 over the whole validation set: every image counted once, counts summed across
workers (never averages of averages). Optionally with flip test-time augmentation. A stop
request leaves an evaluation off (the run saves what it trained instead): each worker looks
between its batches, and the one reduction at the end tells every worker whether any left off,
so all agree."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn as nn

from app.data.pipeline import DeviceBatch, Skipped
from app.parallel.sync import GradientSync
from app.runtime.moments import moment
from app.training.precision import Precision


def correct_counts(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)
                   ) -> torch.Tensor:
    """How many samples have their label among the top-k logits, for each k (on the device)."""
    k_max = min(max(ks), logits.shape[1])
    top = logits.topk(k_max, dim=1).indices
    hits = (top == labels[:, None]).cumsum(dim=1).clamp_(max=1)  # hit within the first j
    return hits[:, [min(k, k_max) - 1 for k in ks]].sum(dim=0)


def mirror_averaged_logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """FFCV's lr_tta: the logits of the images and of their horizontal mirrors, averaged (FFCV
    sums them: the same ranking, but its loss is that of doubled logits). NCHW: width is dim
    3, channels_last or not. Averaged in at least float32, where bf16 would round the mean."""
    first, mirrored = model(images), model(images.flip(3))
    dtype = torch.promote_types(first.dtype, torch.float32)
    return (first.to(dtype) + mirrored.to(dtype)) / 2


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[DeviceBatch], precision: Precision,
             sync: GradientSync, on_skipped: Callable[[list[Skipped]], None] | None = None,
             flip_tta: bool = False, should_stop: Callable[[], bool] = lambda: False
             ) -> dict | None:
    """Metrics over the whole val set; this worker's unreadable images go to `on_skipped`.
    `flip_tta`: rate each image by its mean logits with its mirror. Sums stay on the device until
    the one reduction at the end; image counts are known on the host. None: left off, on every
    worker, because `should_stop()` said so on one."""
    moment("worker:evaluating")
    model.eval()
    device = precision.device
    correct = torch.zeros(2, dtype=torch.float64, device=device)  # top-1, top-5
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    images = skipped = left_off = 0
    for batch in batches:
        if should_stop():
            left_off = 1
            break
        skipped += len(batch.skipped)
        if on_skipped and batch.skipped:
            on_skipped(batch.skipped)
        if not len(batch):
            continue
        with precision.autocast():
            logits = (mirror_averaged_logits(model, batch.images) if flip_tta
                      else model(batch.images))
        loss_sum += nn.functional.cross_entropy(logits.float(), batch.labels, reduction="sum")
        correct += correct_counts(logits, batch.labels)
        images += len(batch)
    counts = torch.tensor([images, skipped, left_off], dtype=torch.float64).to(device)
    correct1, correct5, loss, count, skipped, left_off = sync.sum_across_workers(
        torch.cat([correct, loss_sum, counts])).tolist()
    if left_off:
        return None

    def mean(total: float) -> float:  # NaN when every val image was skipped: nothing to rate
        return total / count if count else float("nan")
    return {"val/top1": mean(correct1), "val/top5": mean(correct5), "val/loss": mean(loss),
            "val/images": int(count), "val/skipped": int(skipped)}

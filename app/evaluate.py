"""Top-1/top-5 over the whole validation set: every image counted once, counts summed across
workers (never averages of averages)."""

from __future__ import annotations

import torch
import torch.nn as nn

from app.parallel import GradientSync
from app.precision import Precision


def correct_counts(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)
                   ) -> list[torch.Tensor]:
    """How many samples have their label among the top-k logits, for each k (on the device)."""
    k_max = min(max(ks), logits.shape[1])
    top = logits.topk(k_max, dim=1).indices
    hits = top == labels[:, None]
    return [hits[:, :min(k, k_max)].any(dim=1).sum() for k in ks]


@torch.no_grad()
def evaluate(model: nn.Module, loader, precision: Precision, sync: GradientSync,
             skipped: list | None = None) -> dict:
    """Metrics over the whole val set; this worker's unreadable images go to `skipped`."""
    model.eval()
    # correct@1, correct@5, summed loss, images, skipped: one tensor, one reduction at the end
    totals = torch.zeros(5, dtype=torch.float64, device=precision.device)
    for batch in loader:
        totals[4] += len(batch.skipped)
        if skipped is not None:
            skipped += batch.skipped
        if not len(batch):
            continue
        images, labels = precision.inputs(batch)
        with precision.autocast():
            logits = model(images)
        loss = nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
        top1, top5 = correct_counts(logits, labels)
        totals[:4] += torch.stack([top1, top5, loss, torch.tensor(len(labels), device=loss.device)]
                                  ).to(totals.dtype)
    correct1, correct5, loss_sum, count, skipped = sync.sum_across_workers(totals).tolist()
    count = max(count, 1)
    return {"val/top1": correct1 / count, "val/top5": correct5 / count,
            "val/loss": loss_sum / count, "val/images": int(count), "val/skipped": int(skipped)}

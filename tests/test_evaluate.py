"""Evaluation counts: top-k hits from logits, sums across the whole val set, empty sets."""

import math

import torch

from app.data.pipeline import DeviceBatch
from app.evaluate import correct_counts, evaluate
from app.parallel import LocalSync
from app.precision import Precision


def test_correct_counts_per_k():
    logits = torch.tensor([[0.1, 0.9, 0.0, 0.0, 0.0, 0.0],   # label 1: top-1
                           [0.5, 0.4, 0.3, 0.2, 0.1, 0.0],   # label 4: 5th -> top-5 only
                           [0.5, 0.4, 0.3, 0.2, 0.1, 0.0]])  # label 5: 6th -> neither
    assert correct_counts(logits, torch.tensor([1, 4, 5])).tolist() == [1, 2]
    # fewer classes than k: top-5 of 3 classes is every class
    assert correct_counts(logits[:, :3], torch.tensor([1, 2, 2])).tolist() == [1, 3]


class Fixed(torch.nn.Module):
    """Predicts class = the first pixel's value, whatever the batch."""

    def forward(self, images):
        return torch.nn.functional.one_hot(images[:, 0, 0, 0].long(), 4).float() * 10


def batch(predicted, labels, skipped=()):
    images = torch.tensor(predicted, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, 2, 2)
    return DeviceBatch(images, torch.tensor(labels), list(skipped))


def test_evaluate_counts_each_image_once_over_batches():
    precision = Precision.from_config("off", False, "cpu")
    metrics = evaluate(Fixed(), [batch([0, 1, 2], [0, 1, 3]), batch([3], [3]),
                                 batch([], [], skipped=["x"])], precision, LocalSync())
    assert metrics["val/images"] == 4 and metrics["val/skipped"] == 1
    assert metrics["val/top1"] == 3 / 4


def test_evaluate_on_an_empty_val_set_reports_zero_images():
    precision = Precision.from_config("off", False, "cpu")
    metrics = evaluate(Fixed(), [], precision, LocalSync())
    assert metrics["val/images"] == 0 and metrics["val/skipped"] == 0
    assert math.isnan(metrics["val/top1"]) and math.isnan(metrics["val/loss"])

"""Evaluation counts: top-k hits from logits, sums across the whole val set, empty sets."""

import math

import pytest
import torch

from app.data.pipeline import DeviceBatch
from app.parallel.sync import LocalSync
from app.training.evaluate import correct_counts, evaluate
from app.training.precision import Precision


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


def test_flip_tta_rates_the_mean_of_the_image_and_mirror_logits():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 6, 7)).double()
    images, labels = torch.randn(2, 9, 3, 4, 6, dtype=torch.float64), torch.randint(0, 7, (2, 9))
    precision = Precision.from_config("off", False, "cpu", "float64")
    metrics = evaluate(model, [DeviceBatch(x, y) for x, y in zip(images, labels)], precision,
                       LocalSync(), flip_tta=True)
    with torch.no_grad():
        x, y = images.flatten(0, 1), labels.flatten()
        logits = (model(x) + model(x.flip(-1))) / 2  # the mirror: width reversed
        assert not torch.allclose(logits, model(x))  # the model is not flip-symmetric
        hits = correct_counts(logits, y).double() / len(y)
        loss = torch.nn.functional.cross_entropy(logits, y)
    assert (metrics["val/top1"], metrics["val/top5"]) == tuple(hits.tolist())
    assert metrics["val/loss"] == pytest.approx(loss.item(), rel=1e-6)  # summed in float32
    assert metrics["val/images"] == 18


class LeftColumn(torch.nn.Module):
    """Predicts class = the top-left pixel's value, more confidently for larger values."""

    def forward(self, images):
        value = images[:, 0, 0, 0]
        return torch.nn.functional.one_hot(value.long(), 4).float() * (value[:, None] + 1)


def test_flip_tta_can_change_the_prediction():
    # left 0, right 2: alone the image says class 0 (logit 1); its mirror says class 2 (logit
    # 3), which wins the mean.
    images = torch.tensor([[0.0, 2.0]]).expand(1, 3, 1, 2)
    batches = [DeviceBatch(images, torch.tensor([2]))]
    precision = Precision.from_config("off", False, "cpu")
    plain = evaluate(LeftColumn(), batches, precision, LocalSync())
    tta = evaluate(LeftColumn(), batches, precision, LocalSync(), flip_tta=True)
    assert (plain["val/top1"], tta["val/top1"]) == (0.0, 1.0)
    assert tta["val/loss"] < plain["val/loss"]

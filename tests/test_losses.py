"""app/training/losses.py against timm: BinaryCrossEntropy fed the targets timm's train.py
feeds it."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data.mixup import one_hot as timm_one_hot
from timm.loss import BinaryCrossEntropy

from app.config import ModelConfig
from app.data.batch_augment import apply_mix, Mix, one_hot
from app.training.losses import SmoothedBinaryCrossEntropy, build_criterion

CLASSES = 7


@pytest.fixture
def batch():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, CLASSES, generator=generator, dtype=torch.float64) * 3
    labels = torch.randint(0, CLASSES, (6,), generator=generator)
    return logits, labels


def bce(logits, targets):
    """The loss written out: mean over images and classes."""
    return -(targets * F.logsigmoid(logits) + (1 - targets) * F.logsigmoid(-logits)).mean()


def timm_mixed_targets(labels, lam, smoothing):
    """timm's Mixup targets (mixup_target), with our pairing: the batch rolled by one. timm
    builds them in float32, hence the float32 tolerance of the comparisons below."""
    off = smoothing / CLASSES
    rows = timm_one_hot(labels, CLASSES, on_value=1 - smoothing + off, off_value=off).double()
    return lam * rows + (1 - lam) * rows.roll(1, 0)


def mixed_by_batch_augment(labels, lam):
    targets = one_hot(labels, CLASSES, torch.float64)
    apply_mix(torch.zeros(len(labels), 3, 4, 4, dtype=torch.float64), targets, Mix(lam))
    return targets


def test_index_targets_are_smoothed_as_timm_smooths_them(batch):
    logits, labels = batch
    loss = build_criterion(ModelConfig(bce_loss=True), label_smoothing=0.1)(logits, labels)
    expected = BinaryCrossEntropy(smoothing=0.1)(logits, labels)
    assert torch.allclose(loss, expected, rtol=1e-12, atol=0)
    on, off = 1 - 0.1 + 0.1 / CLASSES, 0.1 / CLASSES
    targets = torch.full_like(logits, off).scatter_(1, labels.view(-1, 1), on)
    assert torch.allclose(loss, bce(logits, targets), rtol=1e-12, atol=0)


def test_without_smoothing_it_is_still_bce(batch):
    logits, labels = batch
    loss = build_criterion(ModelConfig(bce_loss=True), label_smoothing=0.0)(logits, labels)
    assert torch.allclose(loss, bce(logits, F.one_hot(labels, CLASSES).double()), rtol=1e-12)


@pytest.mark.parametrize("threshold", [0.0, 0.2])
def test_mixed_targets_meet_smoothing_and_threshold_as_in_timms_train_py(batch, threshold):
    """timm: Mixup(label_smoothing=s) makes the targets, BinaryCrossEntropy(target_threshold)
    takes them as they are. Here: batch augmentation mixes plain rows, the loss smooths."""
    logits, labels = batch
    criterion = build_criterion(ModelConfig(bce_loss=True, bce_target_thresh=threshold), 0.1)
    loss = criterion(logits, mixed_by_batch_augment(labels, lam=0.7))
    reference = BinaryCrossEntropy(target_threshold=threshold or None)
    expected = reference(logits, timm_mixed_targets(labels, 0.7, smoothing=0.1))
    assert torch.allclose(loss, expected, rtol=1e-6, atol=0)
    if threshold:  # both classes of each mixed pair (0.7 and 0.3 > 0.2) become 1
        binary = (timm_mixed_targets(labels, 0.7, 0.1) > threshold).double()
        assert torch.allclose(loss, bce(logits, binary), rtol=1e-12, atol=0)
        assert not torch.allclose(loss, bce(logits, timm_mixed_targets(labels, 0.7, 0.1)),
                                  rtol=1e-3)


def test_half_precision_logits_get_float32_targets(batch):
    """Under autocast the logits are bf16: the smoothed targets must not round to bf16."""
    logits, labels = batch
    criterion = SmoothedBinaryCrossEntropy(smoothing=0.1)
    low = logits.to(torch.bfloat16)
    loss = criterion(low, labels)
    assert loss.dtype == torch.float32
    expected = BinaryCrossEntropy(smoothing=0.1)(low.float(), labels)
    assert torch.equal(loss, expected)


def test_cross_entropy_stays_the_default():
    criterion = build_criterion(ModelConfig(), label_smoothing=0.1)
    assert isinstance(criterion, nn.CrossEntropyLoss) and criterion.label_smoothing == 0.1

"""Random erasing and mixup/cutmix on the device (app/data/batch_augment.py): torchvision's
semantics, randomness a pure function of (seed, step, rank), any batch size."""

import math

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from app.data.batch_augment import BatchAugment, cutmix_box

CLASSES = 10


def batch(count=8, size=32, seed=0):
    """Normalised-looking images with no exact zeros, and labels whose neighbours differ."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(count, 3, size, size, generator=generator) + 10.0
    return images, torch.arange(count) % CLASSES


def box_mask(box, size):
    mask = torch.zeros(size, size, dtype=torch.bool)
    if box:
        top, left, h, w = box
        mask[top:top + h, left:left + w] = True
    return mask


# --- random erasing -----------------------------------------------------------------------

def test_erasing_frequency_and_box_shapes_follow_torchvision():
    augment = BatchAugment(random_erase=0.3, num_classes=CLASSES, seed=5)
    boxes = [box for step in range(40) for box in augment.plan(256, 224, 224, step).erase]
    erased = [box for box in boxes if box]
    assert len(boxes) == 40 * 256
    assert abs(len(erased) / len(boxes) - 0.3) < 0.02  # binomial sd 0.005
    areas = [h * w / 224**2 for _, _, h, w in erased]
    ratios = [h / w for _, _, h, w in erased]
    assert 0.02 * 0.95 < min(areas) < 0.03 and 0.31 < max(areas) < 0.33 * 1.05  # scale
    assert 0.3 * 0.95 < min(ratios) < 0.35 and 2.9 < max(ratios) < 3.3 * 1.05  # h / w
    assert abs(sum(math.log(r) for r in ratios) / len(ratios)) < 0.05  # log-uniform
    assert all(0 <= top and top + h <= 224 and 0 <= left and left + w <= 224 and h < 224
               and w < 224 for top, left, h, w in erased)
    # Positions spread over the image, not pinned to a corner.
    assert len({(top, left) for top, left, _, _ in erased}) > 0.9 * len(erased)


@pytest.mark.parametrize("channels_last", [False, True])
def test_erased_pixels_are_exactly_zero_and_the_rest_untouched(channels_last):
    images, labels = batch(16)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    augment = BatchAugment(random_erase=0.5, num_classes=CLASSES, seed=3)
    out, targets = augment(images.clone(), labels, step=7)
    boxes = augment.plan(16, 32, 32, step=7).erase
    assert targets is labels  # erasing alone keeps class indices
    assert 0 < sum(map(bool, boxes)) < 16
    for image, before, box in zip(out, images, boxes):
        mask = box_mask(box, 32).expand(3, 32, 32)
        assert torch.equal(image[mask], torch.zeros(int(mask.sum())))
        assert torch.equal(image[~mask], before[~mask])
        if box:  # torchvision's own erase of that box, value 0: the same pixels
            reference = v2.functional.erase(before, *box, v=torch.tensor(0.0))
            assert torch.equal(image, reference)


# --- mixup --------------------------------------------------------------------------------

def test_mixup_blends_each_image_with_the_previous_one_like_torchvision():
    images, labels = batch(8)
    augment = BatchAugment(mixup_alpha=0.2, num_classes=CLASSES, seed=1)
    mix = augment.plan(8, 32, 32, step=5).mix
    assert mix.box is None and 0 <= mix.lam <= 1
    out, targets = augment(images.clone(), labels, step=5)
    expected = mix.lam * images + (1 - mix.lam) * images.roll(1, 0)
    assert torch.allclose(out, expected, rtol=0, atol=1e-5)
    one_hot = F.one_hot(labels, CLASSES).float()
    assert torch.allclose(targets, mix.lam * one_hot + (1 - mix.lam) * one_hot.roll(1, 0))
    # torchvision's MixUp, handed the same lambda.
    reference = v2.MixUp(alpha=0.2, num_classes=CLASSES)
    reference._dist = FixedLambda(mix.lam)
    tv_images, tv_targets = reference(images, labels)
    assert torch.allclose(out, tv_images, rtol=0, atol=1e-5)
    assert torch.allclose(targets, tv_targets, rtol=0, atol=1e-6)


class FixedLambda:
    def __init__(self, lam):
        self.lam = lam

    def sample(self, shape=()):
        return torch.tensor(self.lam)


def test_lambda_is_a_function_of_seed_epoch_and_the_batchs_place_in_the_epoch():
    images, labels = batch(8)

    def run(seed=0, step=3, rank=0, epoch=0):
        augment = BatchAugment(0.5, mixup_alpha=1.0, num_classes=CLASSES, seed=seed, rank=rank,
                               world_size=2)
        return augment(images.clone(), labels, step, epoch)

    first, again = run(), run()  # a fresh object, as after a resume
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    for other in (run(step=4), run(rank=1), run(seed=1), run(epoch=1)):
        assert not torch.equal(first[1], other[1])  # another lambda
        assert not torch.equal(first[0], other[0])


def test_the_same_micro_batches_draw_alike_however_they_are_spread_over_workers():
    """Worker r of 2 at its batch j holds the images 1 worker accumulating 2 micro-batches
    takes as its batch 2j + r (the sampler's contiguous parts): both draw the same plan."""
    spread = [BatchAugment(0.5, mixup_alpha=1.0, cutmix_alpha=1.0, num_classes=CLASSES,
                           seed=7, rank=rank, world_size=2) for rank in range(2)]
    one = BatchAugment(0.5, mixup_alpha=1.0, cutmix_alpha=1.0, num_classes=CLASSES, seed=7)
    plans = {(j, r): spread[r].plan(8, 32, 32, step=j, epoch=2) for j in range(3)
             for r in range(2)}
    assert all(plans[j, r] == one.plan(8, 32, 32, step=2 * j + r, epoch=2) for j, r in plans)
    assert len({repr(plan) for plan in plans.values()}) == 6  # each batch its own draw


# --- cutmix -------------------------------------------------------------------------------

def test_cutmix_pastes_the_previous_images_box_and_weights_targets_by_its_area():
    images, labels = batch(8)
    augment = BatchAugment(cutmix_alpha=1.0, num_classes=CLASSES, seed=2)
    step = next(s for s in range(50) if augment.plan(8, 32, 32, s).mix.box[2:] != (0, 0))
    mix = augment.plan(8, 32, 32, step).mix
    out, targets = augment(images.clone(), labels, step)
    inside = box_mask(mix.box, 32).expand(8, 3, 32, 32)
    assert torch.equal(out[inside], images.roll(1, 0)[inside])
    assert torch.equal(out[~inside], images[~inside])
    area = mix.box[2] * mix.box[3] / 32**2
    assert mix.lam == 1 - area
    own = targets[torch.arange(8), labels]
    previous = targets[torch.arange(8), labels.roll(1, 0)]
    assert torch.allclose(own, torch.full((8,), 1 - area))
    assert torch.allclose(previous, torch.full((8,), area))
    # torchvision's CutMix, handed the same box and corrected lambda: the same batch.
    reference = v2.CutMix(alpha=1.0, num_classes=CLASSES)
    top, left, h, w = mix.box
    reference.make_params = lambda _: {"box": (left, top, left + w, top + h),
                                       "lam_adjusted": mix.lam}
    tv_images, tv_targets = reference(images, labels)
    assert torch.equal(out, tv_images) and torch.allclose(targets, tv_targets)


class Always:
    """A generator stand-in whose randrange always answers the same position."""

    def __init__(self, where):
        self.where = where

    def randrange(self, n):
        return self.where(n)


def test_cutmix_box_comes_from_lambda_and_is_clipped_at_the_border():
    # lam 0.75: half-sides int(0.5 * sqrt(0.25) * 32) = 8, a 16 x 16 box around the centre.
    assert cutmix_box(32, 32, 0.75, Always(lambda n: n // 2)) == (8, 8, 16, 16)
    # At the corner the box is cut to 8 x 8: the corrected lambda counts what is left.
    assert cutmix_box(32, 32, 0.75, Always(lambda n: 0)) == (0, 0, 8, 8)
    assert cutmix_box(32, 64, 0.0, Always(lambda n: n // 2)) == (0, 0, 32, 64)


def test_with_both_alphas_each_batch_gets_one_method_both_equally_often():
    augment = BatchAugment(mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=CLASSES)
    cutmixes = sum(augment.plan(8, 32, 32, step).mix.box is not None for step in range(400))
    assert 160 < cutmixes < 240  # binomial(400, 0.5): sd 10


# --- batch sizes, off -----------------------------------------------------------------------

def test_any_batch_size_one_image_is_not_mixed_with_itself():
    augment = BatchAugment(1.0, mixup_alpha=0.2, cutmix_alpha=1.0, num_classes=CLASSES)
    empty, targets = augment(torch.zeros(0, 3, 32, 32), torch.zeros(0, dtype=torch.int64), 0)
    assert empty.shape == (0, 3, 32, 32) and targets.shape == (0, CLASSES)
    images, labels = batch(1)
    for step in range(4):
        out, targets = augment(images.clone(), labels, step)
        mask = box_mask(augment.plan(1, 32, 32, step).erase[0], 32).expand(1, 3, 32, 32)
        assert torch.equal(out[~mask], images[~mask])  # only erased
        assert torch.equal(targets, F.one_hot(labels, CLASSES).float())


def test_all_off_hands_the_batch_through_untouched():
    images, labels = batch(4)
    out, targets = BatchAugment(num_classes=CLASSES)(images, labels, 0)
    assert out is images and targets is labels

"""Auto-augment policies against torchvision's: the same ops, magnitudes and policy table, the
same op frequencies over many plans; and the Pillow path's ops pixel for pixel against
torchvision's own `_apply_op` (bilinear, fill 0, as its training recipe calls it)."""

import math
import random
from collections import Counter

import numpy as np
import pytest
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import autoaugment as tv

from app.catalog import tables
from app.data.augment import TrainRecipe
from app.data.auto_augment import (IMAGENET_POLICY, OP_NAMES, WIDE_SPACE, ImageNetAutoAugment,
                                   RandAugment, TrivialAugmentWide, policy, standard_space)
from app.data.image_ops import apply_ops
from pipelines import wide_ops

SIZE = 64
PLANS = 14_000


def within_sigmas(count: int, trials: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - trials * p) <= sigmas * math.sqrt(trials * p * (1 - p))


def draws(chosen, n: int = PLANS) -> list:
    return [chosen.draw(random.Random(seed)) for seed in range(n)]


def assert_space_is_torchvisions(ours, theirs: dict, bins: int) -> None:
    assert [name for name, _ in ours] == list(theirs)
    for name, magnitudes in ours:
        values, signed = theirs[name]
        if magnitudes is None:
            assert values.ndim == 0 and not signed, name
            continue
        assert magnitudes.signed == signed, name
        for index in range(bins):
            expected = float(values[index])
            if name.startswith("Translate"):  # whole pixels: torchvision truncates its float32
                expected = float(int(expected + 1e-5))  # bins, 15.999999 -> 15 (ours: 16)
            assert magnitudes.at(index, bins) == pytest.approx(expected, rel=1e-6, abs=1e-6), \
                (name, index)


def test_trivial_augment_wide_has_torchvisions_ops_and_magnitudes():
    assert_space_is_torchvisions(WIDE_SPACE, tv.TrivialAugmentWide()._augmentation_space(31), 31)


def test_rand_augment_has_torchvisions_ops_and_magnitudes():
    theirs = tv.RandAugment()._augmentation_space(31, (SIZE, SIZE))
    assert_space_is_torchvisions((("Identity", None), *standard_space(SIZE)), theirs, 31)


def test_imagenet_policy_is_torchvisions():
    theirs = tv.AutoAugment(tv.AutoAugmentPolicy.IMAGENET)
    assert IMAGENET_POLICY == tuple(tuple(sub) for sub in theirs.policies)
    space = theirs._augmentation_space(10, (SIZE, SIZE))
    assert_space_is_torchvisions(standard_space(SIZE), {k: v for k, v in space.items()
                                                        if k != "Invert"}, 10)


def test_trivial_augment_wide_draws_one_op_uniformly_with_uniform_bins_and_signs():
    plans = draws(TrivialAugmentWide())
    assert {len(ops) for ops in plans} == {1}
    names = Counter(ops[0][0] for ops in plans)
    assert set(names) == {name for name, _ in WIDE_SPACE}
    assert all(within_sigmas(names[name], PLANS, 1 / 14) for name in names), names
    rotations = [m for ((name, m),) in plans if name == "Rotate"]
    assert within_sigmas(sum(m < 0 for m in rotations), len(rotations), 0.5)
    bins = Counter(round(abs(m) / 4.5) for m in rotations)  # 135 degrees over 30 bins
    assert set(bins) == set(range(31))
    assert all(within_sigmas(bins[b], len(rotations), 1 / 31) for b in bins), bins
    # unsigned ops keep their sign; posterize spans 8 down to 2 bits, solarize 255 down to 0
    posterize = {m for ((name, m),) in plans if name == "Posterize"}
    assert posterize == {8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0}
    solarize = [m for ((name, m),) in plans if name == "Solarize"]
    assert min(solarize) == 0.0 and max(solarize) == 255.0


@pytest.mark.parametrize("magnitude", [9, 0, 30])
def test_rand_augment_draws_two_ops_at_the_given_bin(magnitude):
    plans = draws(RandAugment(SIZE, magnitude))
    assert {len(ops) for ops in plans} == {2}
    names = Counter(name for ops in plans for name, _ in ops)
    assert len(names) == 14 and "Invert" not in names
    assert all(within_sigmas(names[name], 2 * PLANS, 1 / 14) for name in names), names
    space = dict(standard_space(SIZE))
    for name, value in {op for ops in plans for op in ops}:
        expected = 0.0 if space.get(name) is None else space[name].at(magnitude, 31)
        assert abs(value) == expected, (name, value)
    # repeats are allowed: the two ops are independent draws
    assert within_sigmas(sum(a[0] == b[0] for a, b in plans), PLANS, 1 / 14)


def test_imagenet_policy_applies_each_sub_policys_ops_with_their_probabilities():
    plans = draws(ImageNetAutoAugment(SIZE))
    space = dict(standard_space(SIZE), Invert=None)
    # expected count of every op over the plans: each sub-policy is chosen 1/25 of the time
    expected = Counter()
    for sub in IMAGENET_POLICY:
        for name, probability, _ in sub:
            expected[name] += PLANS * probability / 25
    seen = Counter(name for ops in plans for name, _ in ops)
    assert set(seen) == set(expected)
    assert all(abs(seen[n] - expected[n]) <= 5 * math.sqrt(expected[n]) for n in seen), seen
    # every plan is a sub-policy with some of its ops left out, in order, at their bins
    allowed = set()
    for sub in IMAGENET_POLICY:
        ops = [(name, 0.0 if index is None else space[name].at(index, 10))
               for name, _, index in sub]
        allowed |= {(), (ops[0],), (ops[1],), tuple(ops)}
    assert {tuple((n, abs(m)) for n, m in ops) for ops in plans} <= allowed
    # (Equalize 0.0, Equalize 0.8): probability 0 never applies
    both = sum(len(ops) == 2 for ops in plans)
    assert within_sigmas(both, PLANS, sum(a[1] * b[1] for a, b in IMAGENET_POLICY) / 25)


@pytest.mark.parametrize("name", ["ta_wide", "ra", "imagenet"])
def test_auto_augment_leaves_crops_and_flips_as_they_were(name):
    plain, augmented = TrainRecipe(SIZE), TrainRecipe(SIZE, auto_augment=name)
    for seed in range(300):
        a, b = plain.plan(375, 500, seed), augmented.plan(375, 500, seed)
        assert (a.box, a.flip, a.ops) == (b.box, b.flip, ())
        assert augmented.plan(375, 500, seed) == b  # a function of the seed
    assert len({augmented.plan(375, 500, seed).ops for seed in range(300)}) > 50


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="known: off, ta_wide, ra, imagenet"):
        policy("augmix", SIZE)


@pytest.fixture(scope="module")
def photo(tiny_sample) -> Image.Image:
    """A real sample image, cropped and resized as a plan would leave it."""
    folder = tiny_sample / tables.TRAIN_DIR
    path = sorted(folder.rglob("*.JPEG"))[5]
    with Image.open(path) as image:
        return image.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)


def test_pillow_ops_are_torchvisions(photo):
    assert {name for name, _ in wide_ops((3, 17, 30))} == set(OP_NAMES)
    for name, magnitude in wide_ops((3, 17, 30)):
        theirs = tv._apply_op(photo, name, magnitude, InterpolationMode.BILINEAR, None)
        ours = apply_ops(photo, ((name, magnitude),))
        assert np.array_equal(np.asarray(ours), np.asarray(theirs)), (name, magnitude)

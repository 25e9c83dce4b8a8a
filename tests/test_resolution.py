"""Image sizes: FFCV's progressive resizing, torchvision's val resize and crop, their flags."""

import numpy as np
import pytest

from app.config import Config, DataConfig
from app.config.checks import validate
from app.config.sources import parse_config
from app.data.resolution import TrainSizes, resolve
from app.runtime.errors import UserError


def ffcv_resolution(epoch, min_res, max_res, start_ramp, end_ramp):
    """FFCV's rule as its train_imagenet.py states it, in numpy: np.interp, then np.round to
    a multiple of 32, clamped to the ends."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interpolated = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])[0]
    return int(np.round(interpolated / 32)) * 32


@pytest.mark.parametrize("epochs, ramp", [(88, (160, 192, 65, 76)), (16, (160, 192, 11, 13)),
                                          (40, (160, 256, 10, 30))])
def test_train_sizes_follow_ffcvs_schedule(epochs, ramp):
    """FFCV's ResNet-50 88- and 16-epoch configs, and a wider ramp that passes 224."""
    sizes = TrainSizes(*ramp)
    expected = [ffcv_resolution(epoch, *ramp) for epoch in range(epochs)]
    assert [sizes.at(epoch) for epoch in range(epochs)] == expected
    assert sizes.distinct(epochs) == list(dict.fromkeys(expected))
    assert len(set(expected)) > 1 and all(size % 32 == 0 for size in expected)


def test_a_fixed_size_is_the_same_every_epoch():
    assert {TrainSizes.fixed(176).at(epoch) for epoch in range(600)} == {176}


def test_torchvisions_sizes_from_the_flags():
    # torchvision's defaults: 224 crops, val resize 256
    default = resolve(224)
    assert (default.train.at(0), default.val_resize, default.val_crop) == (224, 256, 224)
    # its ResNet-50 recipe: --train-crop-size 176 --val-resize-size 232 (val crop 224)
    tv2 = resolve(224, train_crop=176, val_resize=232)
    assert (tv2.train.at(0), tv2.val_resize, tv2.val_crop) == (176, 232, 224)
    assert tv2.val_crop_fraction == pytest.approx(224 / 232)
    # --image-size sets both crops; FFCV validates at 256 (resize 256 / 0.875)
    small = resolve(224, image_size=32)
    assert (small.train.at(0), small.val_crop) == (32, 32)
    assert resolve(224, val_crop=256).val_resize == 293
    progressive = resolve(224, progressive=(160, 192, 65, 76))
    assert progressive.train == TrainSizes(160, 192, 65, 76) and progressive.val_crop == 224


@pytest.mark.parametrize("flags, message", [
    (["--progressive-start-size", "160"], "needs both"),
    (["--progressive-start-size", "160", "--progressive-end-size", "192",
      "--progressive-start-epoch", "5", "--progressive-end-epoch", "5"], "must be after"),
    (["--train-crop-size", "176", "--progressive-start-size", "160",
      "--progressive-end-size", "192", "--progressive-end-epoch", "5"], "not both"),
])
def test_inconsistent_progressive_flags_are_refused(flags, message):
    with pytest.raises(UserError, match=message):
        parse_config(flags)


def test_a_progressive_config_is_accepted():
    validate(Config(data=DataConfig(progressive_start_size=160, progressive_end_size=192,
                                    progressive_start_epoch=65, progressive_end_epoch=76)))

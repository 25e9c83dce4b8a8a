"""Image sizes: the train crop of each epoch (fixed, or FFCV's progressive resizing) and the
validation resize and crop (torchvision's --train-crop-size, --val-resize-size, --val-crop-size).

The train size is a pure function of the epoch, so both pipelines, a resumed run and the
compiled model agree on it without anyone keeping it. Plain Python: DALI's reader processes
import this module."""

from __future__ import annotations

from dataclasses import dataclass

ROUND_TO = 32  # FFCV rounds the ramp's sizes to multiples of 32
DEFAULT_CROP_FRACTION = 0.875  # torchvision's 224 of 256, FFCV's DEFAULT_CROP_RATIO


@dataclass(frozen=True)
class TrainSizes:
    """The train crop size of epoch e (from 0, as FFCV counts): `start` up to `start_epoch`,
    `end` from `end_epoch` on, linear in between, rounded to a multiple of 32 (FFCV's ResNet-50
    88-epoch config: TrainSizes(160, 192, 65, 76))."""
    start: int
    end: int
    start_epoch: int = 0
    end_epoch: int = 0

    @classmethod
    def fixed(cls, size: int) -> "TrainSizes":
        return cls(size, size)

    @property
    def progressive(self) -> bool:
        return self.start != self.end

    def at(self, epoch: int) -> int:
        if not self.progressive or epoch <= self.start_epoch:
            return self.start
        if epoch >= self.end_epoch:
            return self.end
        share = (epoch - self.start_epoch) / (self.end_epoch - self.start_epoch)
        return round((self.start + share * (self.end - self.start)) / ROUND_TO) * ROUND_TO

    def distinct(self, epochs: int) -> list[int]:
        """The sizes a run of `epochs` epochs trains at, in order of first use."""
        return list(dict.fromkeys(self.at(epoch) for epoch in range(epochs)))


@dataclass(frozen=True)
class Resolution:
    train: TrainSizes
    val_crop: int
    val_resize: int

    @property
    def val_crop_fraction(self) -> float:
        return self.val_crop / self.val_resize

    def describe(self, epochs: int) -> str:
        train = self.train.distinct(epochs)
        if len(train) == 1:
            words = f"train {train[0]} px"
        else:
            t = self.train
            words = (f"train {t.start} -> {t.end} px over epochs {t.start_epoch + 1}-"
                     f"{t.end_epoch + 1} ({', '.join(map(str, train))})")
        return f"{words}, val resize {self.val_resize} crop {self.val_crop} px"


def resolve(default: int, image_size: int = 0, train_crop: int = 0, val_resize: int = 0,
            val_crop: int = 0, progressive: tuple[int, int, int, int] = (0, 0, 0, 0)
            ) -> Resolution:
    """The run's sizes from its flags (0: unset): `image_size` (else `default`) sets both
    crops, the val resize defaults to crop / 0.875, and `progressive` (start size, end size,
    start epoch, end epoch) replaces the train crop."""
    crop = image_size or default
    start, end, start_epoch, end_epoch = progressive
    train = TrainSizes(start, end, start_epoch, end_epoch) if start else \
        TrainSizes.fixed(train_crop or crop)
    val_crop = val_crop or crop
    return Resolution(train, val_crop, val_resize or round(val_crop / DEFAULT_CROP_FRACTION))

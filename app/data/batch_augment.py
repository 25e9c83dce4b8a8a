"""Per-batch augmentations on the training device: random erasing, then mixup or cutmix, one
implementation whatever decoder made the DeviceBatch.

Every random number is drawn on the host from generators seeded by the seed, the epoch and the
micro-batch's place in the epoch's global order (worker r's batch j is the (j x world_size +
r)-th run of `batch size` images: app/data/sampler.py). So the device never tells the host
anything, and a resumed run draws the same numbers, as does a run that holds the same
micro-batches another way (2 workers x 8 images, or 1 worker x 8 x 2 accumulated). Another
per-worker batch size mixes other groups (mixup pairs images within a worker's batch, as
torchvision and timm do); seeding erasing per image would cost a generator per image.

Semantics are torchvision's (references/classification, transforms.v2): RandomErasing after
Normalize (fill 0 is the mean); MixUp or CutMix per batch; targets become the same mix of
one-hot rows (label smoothing, a linear map, commutes with the mix).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from app.data.augment import Box
from app.data.sampler import mix_seed

if TYPE_CHECKING:  # the data layer does not depend on the config at run time
    from app.config import AugmentConfig

ERASE_SCALE = (0.02, 0.33)  # share of the image's area
ERASE_RATIO = (0.3, 3.3)  # height / width
ERASE_TRIES = 10
# A fourth value keeps these streams apart from each other and from the per-image crop seeds;
# erasing on or off then changes nothing of the mixing.
ERASE_STREAM, MIX_STREAM = 1, 2


# --- host: the plan of one batch, plain Python --------------------------------------------

def erase_box(height: int, width: int, rng: random.Random) -> Box | None:
    """torchvision's RandomErasing box; None (the image left as it is) when none fits."""
    area = height * width
    log_ratio = (math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1]))
    for _ in range(ERASE_TRIES):
        erase_area = area * rng.uniform(*ERASE_SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        h = round(math.sqrt(erase_area * aspect))
        w = round(math.sqrt(erase_area / aspect))
        if h < height and w < width:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    return None


def erase_plan(count: int, height: int, width: int, p: float, rng: random.Random
               ) -> list[Box | None]:
    """Each image's box, or None, drawn in batch order (torchvision decides per image before
    batching); the device erases the whole batch at once."""
    return [erase_box(height, width, rng) if rng.random() < p else None for _ in range(count)]


@dataclass(frozen=True)
class Mix:
    """One batch's mix: images and targets become lam * own + (1 - lam) * the batch rolled by
    one; with a box (cutmix) the images mix by pasting the rolled batch's box, and lam is the
    share of the image outside the box."""
    lam: float
    box: Box | None = None


def cutmix_box(height: int, width: int, lam: float, rng: random.Random) -> Box:
    """torchvision v2 CutMix's box: a centre uniform over the pixels, half-sides of
    sqrt(1 - lam) / 2 of the image's sides (truncated), clipped at the borders."""
    centre_y, centre_x = rng.randrange(height), rng.randrange(width)
    r = 0.5 * math.sqrt(1.0 - lam)
    half_h, half_w = int(r * height), int(r * width)
    top, left = max(centre_y - half_h, 0), max(centre_x - half_w, 0)
    bottom, right = min(centre_y + half_h, height), min(centre_x + half_w, width)
    return top, left, bottom - top, right - left


def mix_plan(height: int, width: int, mixup_alpha: float, cutmix_alpha: float,
             rng: random.Random) -> Mix | None:
    """Mixup or cutmix (equally likely when both are on, as torchvision's RandomChoice)."""
    methods = [name for name, alpha in (("mixup", mixup_alpha), ("cutmix", cutmix_alpha))
               if alpha > 0]
    if not methods:
        return None
    method = rng.choice(methods) if len(methods) > 1 else methods[0]
    if method == "mixup":
        return Mix(rng.betavariate(mixup_alpha, mixup_alpha))
    box = cutmix_box(height, width, rng.betavariate(cutmix_alpha, cutmix_alpha), rng)
    return Mix(1.0 - box[2] * box[3] / (height * width), box)


@dataclass(frozen=True)
class BatchPlan:
    erase: list[Box | None]  # per image; empty when erasing is off
    mix: Mix | None


# --- device: apply a plan, no value ever read back ------------------------------------------

def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # pinned: the copy is queued, the host does not wait for the GPU
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def erase(images: torch.Tensor, boxes: list[Box | None]) -> None:
    """Set each image's box to 0 in place. The boxes travel as one small tensor and one mask
    covers the batch: a handful of kernels whatever the batch size, not one per image."""
    bounds = torch.tensor([(b[0], b[1], b[0] + b[2], b[1] + b[3]) if b else (0, 0, 0, 0)
                           for b in boxes], dtype=torch.int64)
    top, left, bottom, right = _to_device(bounds, images.device).view(-1, 4, 1, 1).unbind(1)
    height, width = images.shape[-2:]
    rows = torch.arange(height, device=images.device).view(1, height, 1)
    cols = torch.arange(width, device=images.device).view(1, 1, width)
    inside = (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)
    images.masked_fill_(inside.unsqueeze(1), 0.0)


def one_hot(labels: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """(n, num_classes) rows; scatter_, because F.one_hot checks the labels' range by reading
    it back on some devices."""
    rows = torch.zeros(labels.shape[0], num_classes, dtype=dtype, device=labels.device)
    return rows.scatter_(1, labels.unsqueeze(1), 1.0)


def blend_with_rolled(x: torch.Tensor, lam: float) -> torch.Tensor:
    """x = lam * x + (1 - lam) * x.roll(1, 0), in place (the roll is a copy, taken first)."""
    rolled = x.roll(1, 0)
    return x.mul_(lam).add_(rolled, alpha=1.0 - lam)


def paste_rolled(images: torch.Tensor, box: Box) -> None:
    """Each image's box takes the previous image's pixels (the batch rolled by one)."""
    top, left, h, w = box
    region = images[:, :, top:top + h, left:left + w]
    region.copy_(region.roll(1, 0))


def apply_mix(images: torch.Tensor, targets: torch.Tensor, mix: Mix) -> None:
    if images.shape[0] < 2:
        return  # a lone image is paired with itself: the mix is the image and its label
    if mix.box is None:
        blend_with_rolled(images, mix.lam)
    else:
        paste_rolled(images, mix.box)
    blend_with_rolled(targets, mix.lam)


class BatchAugment:
    """Random erasing and mixup/cutmix of one worker's batches; all off, a pass-through."""

    def __init__(self, random_erase: float = 0.0, mixup_alpha: float = 0.0,
                 cutmix_alpha: float = 0.0, *, num_classes: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        self.random_erase, self.mixup_alpha, self.cutmix_alpha = \
            random_erase, mixup_alpha, cutmix_alpha
        self.num_classes, self.seed, self.rank, self.world_size = \
            num_classes, seed, rank, world_size

    @classmethod
    def from_config(cls, config: AugmentConfig, num_classes: int, seed: int, rank: int,
                    world_size: int = 1) -> "BatchAugment":
        return cls(config.random_erase, config.mixup_alpha, config.cutmix_alpha,
                   num_classes=num_classes, seed=seed, rank=rank, world_size=world_size)

    @property
    def mixes(self) -> bool:
        """Targets become probability rows (the loss takes soft targets)."""
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def plan(self, count: int, height: int, width: int, step: int, epoch: int = 0
             ) -> BatchPlan:
        """Everything random about this worker's micro-batch `step` of `epoch`: a pure function
        of the seed, the epoch, the batch's place in the epoch's global order and its shape."""
        place = step * self.world_size + self.rank
        erase_rng = random.Random(mix_seed(self.seed, epoch, place, ERASE_STREAM))
        mix_rng = random.Random(mix_seed(self.seed, epoch, place, MIX_STREAM))
        boxes = erase_plan(count, height, width, self.random_erase, erase_rng) \
            if self.random_erase > 0 else []
        return BatchPlan(boxes, mix_plan(height, width, self.mixup_alpha, self.cutmix_alpha,
                                         mix_rng))

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, step: int, epoch: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for the loss: with mixing on, targets are probability rows in the
        images' dtype. In place: the pipelines hand over a fresh tensor per batch that nothing
        reads afterwards."""
        if not (self.random_erase > 0 or self.mixes):
            return images, labels
        plan = self.plan(images.shape[0], images.shape[-2], images.shape[-1], step, epoch)
        if any(plan.erase):
            erase(images, plan.erase)
        if plan.mix is None:
            return images, labels
        targets = one_hot(labels, self.num_classes, images.dtype)
        apply_mix(images, targets, plan.mix)
        return images, targets

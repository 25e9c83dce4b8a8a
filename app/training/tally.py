"""Loss and image counts summed over steps, kept where they are cheap to add to."""

from __future__ import annotations

import torch


class Tally:
    """Running sums over some steps: loss x images on the device (no sync per step), image
    counts on the host (known without asking the device)."""

    def __init__(self, device: torch.device):
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.images = 0
        self.skipped = 0

    def add(self, loss: torch.Tensor | None, images: int, skipped: int) -> None:
        if loss is not None:
            self.loss_sum.add_(loss, alpha=images)
        self.images += images
        self.skipped += skipped

    def move_into(self, other: "Tally") -> None:
        other.loss_sum.add_(self.loss_sum)
        other.images += self.images
        other.skipped += self.skipped
        self.loss_sum.zero_()
        self.images = self.skipped = 0

    def as_tensor(self) -> torch.Tensor:
        """[loss x images, images, skipped]: one tensor, one reduction across workers."""
        counts = torch.tensor([self.images, self.skipped], dtype=torch.float64)
        return torch.cat([self.loss_sum.view(1), counts.to(self.loss_sum.device)])

    def load(self, sums: torch.Tensor) -> None:
        loss_sum, images, skipped = sums.tolist()
        self.loss_sum.fill_(loss_sum)
        self.images, self.skipped = int(images), int(skipped)

"""The peer's input pipeline, for baselines measured in the same run: pytorch/examples
imagenet/main.py's ImageFolder-style dataset (Pillow, RGB), torchvision's RandomResizedCrop,
flip, ToTensor and Normalize in DataLoader processes, float32 NCHW batches moved in the loop."""

from __future__ import annotations

from typing import Iterator

import pandas as pd
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from app.catalog.storage import DatasetRoot
from app.data.augment import IMAGENET_MEAN, IMAGENET_STD


class PeerDataset(Dataset):
    def __init__(self, root: DatasetRoot, frame: pd.DataFrame, size: int):
        self.root, self.paths, self.labels = root, list(frame.path), list(frame.label)
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        with self.root.fs.open(self.root.path(self.paths[index]), "rb") as handle:
            image = Image.open(handle).convert("RGB")
        return self.transform(image), self.labels[index]


def peer_batches(root: DatasetRoot, frame: pd.DataFrame, size: int, batch_size: int,
                 workers: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches on the device, epoch after epoch, as main.py's loop receives them."""
    loader = DataLoader(PeerDataset(root, frame, size), batch_size=batch_size, shuffle=True,
                        num_workers=workers, pin_memory=device.type == "cuda",
                        persistent_workers=workers > 0)
    while True:
        for images, labels in loader:
            yield (images.to(device, non_blocking=True), labels.to(device, non_blocking=True))

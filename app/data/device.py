"""Host batches -> the training device: the one place where pixels are moved and normalised.

Loaders ship uint8 NHWC pixels (4x less data than float32); on the device a permute makes them
NCHW with channels_last strides without a copy, and the one dtype conversion writes the model's
memory format. Mean and std live on the device, so a step copies nothing but the batch.
"""

from __future__ import annotations

import torch

from app.data.pipeline import InputFormat


def pixel_statistics(mean: tuple[float, ...], std: tuple[float, ...], dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std for pixels in [0, 255], shaped (3, 1, 1), in `dtype`: the normalisation
    training, evaluation and predict share."""
    def scaled(values: tuple[float, ...]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).mul(255.0).view(3, 1, 1)
    return scaled(mean), scaled(std)


class ToDevice:
    def __init__(self, form: InputFormat):
        self.form = form
        self.mean, self.std = (t.to(form.device) for t in
                               pixel_statistics(form.mean, form.std, form.dtype))
        self.memory_format = torch.channels_last if form.channels_last else \
            torch.contiguous_format

    def __call__(self, images: torch.Tensor, labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 (n, H, W, 3) and int64 (n,) on the host (pinned when the device is a GPU)
        -> normalised (n, 3, H, W) and labels on the device."""
        images = images.to(self.form.device, non_blocking=True).permute(0, 3, 1, 2)
        return self.normalise(images), labels.to(self.form.device, non_blocking=True)

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (n, 3, H, W) on the device -> the model's dtype and memory format, normalised."""
        images = images.to(dtype=self.form.dtype, memory_format=self.memory_format)
        return images.sub_(self.mean).div_(self.std)

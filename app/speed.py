"""The speed switches users expect: torch.compile, cuDNN autotuning, TF32.

torch.compile specialises its graph on the batch size. A short batch (the last of an epoch,
or one with skipped images) would compile a second graph, and the automatic dynamic-shape
graph that follows can replace the fast static one for every later step. Padding is no way
out either: padded images would enter the BatchNorm statistics. So full batches run the
compiled graph and any other size runs the same module eagerly: one compilation per mode
(train, eval) for the whole run, and the odd step costs eager speed only.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def compile_enabled(setting: str, device: torch.device) -> bool:
    """`auto` compiles on CUDA only: on a CPU the compile time (~45 s for a small ResNet on 2
    cores, measured) outweighs the gain of a short run."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def configure_backends(device: torch.device, cudnn_benchmark: bool, tf32: bool) -> None:
    """Process-wide switches; only CUDA has them."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.benchmark = cudnn_benchmark  # fixed input sizes: autotune once
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


class CompiledForFullBatches(nn.Module):
    """Wraps the module to train (bare, or as the GradientSync prepared it): full batches go
    through torch.compile, others through the module itself. `.module` is the wrapped module,
    so checkpoint.unwrap and every .parameters()/.buffers()/.train() see through it."""

    def __init__(self, module: nn.Module, batch_size: int, backend: str):
        super().__init__()
        self.module = module
        self.batch_size = batch_size
        # Not a registered submodule: the compiled wrapper holds the same parameters.
        self.__dict__["compiled"] = torch.compile(module, backend=backend)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[0] == self.batch_size:
            return self.compiled(images)
        return self.module(images)

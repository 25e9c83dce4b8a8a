"""The speed switches users expect: torch.compile, cuDNN autotuning, TF32.

torch.compile specialises its graph on the batch size: a short batch (an epoch's last, or one
with skipped images) would compile a second graph, and the dynamic-shape graph that follows can
replace the fast static one for every later step; padding would put padded images into the
BatchNorm statistics. So full batches run the compiled graph and other sizes the same module
eagerly. Regions are compiled, not the whole model: a compiled backward is one autograd node,
so with the whole model compiled every gradient appears at the end of backward, and the
parameter server's buckets could only leave then; with one node per block of a ResNet's stages
a bucket leaves once its blocks are done. Blocks of a stage share their code: a few graphs.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn as nn

from app.runtime.private_api import allow_graphs_per_code, compiled_graphs
from app.training import checkpoint

log = logging.getLogger("imagenet_dp")


def compile_enabled(setting: str, device: torch.device) -> bool:
    """`auto` compiles on CUDA only: on a CPU the compile time outweighs the gain of a short
    run (ResNet-50 at 96 px on 2 cores: 107 s of inductor's compile before the first step)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def configure_backends(device: torch.device, cudnn_benchmark: bool, tf32: bool) -> None:
    """Process-wide switches; only CUDA has them."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.benchmark = cudnn_benchmark  # fixed input sizes: autotune once
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")


class CompiledForFullBatches(nn.Module):
    """Full batches go through the compiled regions, others through the same module eagerly.
    `.module` is the wrapped module, so checkpoint.unwrap, .parameters(), .train() etc. see through
    it; regions are compiled in place (nn.Module.compile), so state_dict keys stay plain."""

    def __init__(self, module: nn.Module, batch_size: int, backend: str, image_sizes: int = 2):
        super().__init__()
        self.module = module
        self.batch_size = batch_size
        # Not a registered submodule: it holds the same parameters (or is the module itself).
        self.__dict__["compiled"] = compile_regions(module, backend, image_sizes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[0] == self.batch_size:
            return self.compiled(images)
        with torch.compiler.set_stance("force_eager"):  # the regions live inside the module
            return self.module(images)


def compile_regions(module: nn.Module, backend: str, image_sizes: int = 2) -> nn.Module:
    """Compile every block of the model's stages in place and return `module`, for inputs of
    `image_sizes` sizes (train sizes, plus val: eval is a graph of its own); a model without stages
    is compiled whole (under DDP, dynamo's DDPOptimizer splits it at DDP's buckets). The stem and
    head stay eager: few FLOPs, and the stem's first conv makes backward's last gradient."""
    blocks = stage_blocks(checkpoint.unwrap(module))
    if not blocks:
        allow_graphs_per_code(image_sizes)
        return torch.compile(module, backend=backend, dynamic=False)
    allow_graphs_per_code(image_sizes * len(blocks))
    for block in blocks:
        # Static shapes: short batches never reach the compiled code (see forward above).
        block.compile(backend=backend, dynamic=False)
    return module


def stage_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of each top-level nn.Sequential whose children are blocks (modules with
    submodules): timm's and torchvision's ResNet layer1..layer4. timm's deep stem (`conv1` of
    test_resnet, resnet50d, ...) is a Sequential of plain layers: stem, not stage."""
    return [block for stage in model.children() if isinstance(stage, nn.Sequential)
            and all(next(b.children(), None) is not None for b in stage)
            for block in stage]


def report_compile_time(step_started: float, device: torch.device, size: int, logger,
                        step: int) -> None:
    """The first compiled step at each train size includes the compilation: a record of its
    own at step `step`, with the count of compiled graphs. Waits for the device once per size."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - step_started
    graphs = compiled_graphs()
    log.info("first compiled step at %d px (compilation included): %.1f s; compiled graphs "
             "so far: %d", size, seconds, graphs)
    logger.log_metrics(step, {"compile/first_step_s": seconds, "compile/graphs": graphs,
                              "train/image_size": size})

"""The speed switches users expect: torch.compile, cuDNN autotuning, TF32.

torch.compile specialises its graph on the batch size. A short batch (the last of an epoch,
or one with skipped images) would compile a second graph, and the automatic dynamic-shape
graph that follows can replace the fast static one for every later step. Padding is no way
out either: padded images would enter the BatchNorm statistics. So full batches run the
compiled graph and any other size runs the same module eagerly: one compilation per mode
(train, eval) and image size for the whole run, and the odd step costs eager speed only.
Progressive resizing adds one graph per train size (`compiled_graphs` counts them), never one
per step: shapes stay static, each new size compiles once and is reused from then on.

What is compiled are regions, not the whole model: each block of a ResNet's stages. A compiled
backward is one autograd node, so with the whole model compiled every parameter's gradient
appeared at the very end of backward, and the parameter server's buckets (hooks on each
parameter) could only leave then. With one node per block, a bucket leaves as soon as the blocks
holding its parameters are done, while backward goes on with the earlier blocks, as in eager
mode. Blocks of a stage share their code, so compiling them costs a few graphs, not a model's.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn as nn

from app.training import checkpoint

log = logging.getLogger("imagenet_dp")


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
    through the compiled regions, others run the same module eagerly. `.module` is the wrapped
    module, so checkpoint.unwrap and every .parameters()/.buffers()/.train() see through it;
    regions are compiled in place (nn.Module.compile), so state_dict keys stay plain."""

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
    `image_sizes` sizes (train sizes, plus the val size: eval is a graph of its own); a model
    without stages is compiled whole (one region: its buckets leave after backward, and under
    DDP dynamo's DDPOptimizer splits the graph at DDP's buckets instead).

    The stem and the head stay eager: a ResNet's stem is one conv+bn+relu+maxpool and its head a
    pool+linear, run once per step (~3% of ResNet-50's FLOPs at 224 px), and the stem's first
    conv makes the last gradient of backward, after which there is nothing left to overlap."""
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


def allow_graphs_per_code(graphs: int) -> None:
    """The blocks of a ResNet share one `forward` code object, and dynamo keeps at most
    `recompile_limit` (8) graphs per code object, then runs the rest eagerly with a warning.
    Blocks differ in shapes and in having a downsample, and train and eval are two graphs each:
    resnet18 needs 14 and resnet50 16, and each further image size as many again. At most one
    graph per region, mode and size is the bound (short batches never compile), so the limit
    is raised to it."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, graphs)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, graphs)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters  # noqa: PLC0415  (dynamo's own bookkeeping)
    return counters["stats"]["unique_graphs"]


def report_compile_time(step_started: float, device: torch.device, size: int, logger,
                        step: int) -> None:
    """The first compiled step at each train size includes the compilation (about a minute
    for a ResNet-50): worth a record of its own, logged at optimizer step `step`, with the
    count of compiled graphs (one per region, mode and size, never one per step). Waits for
    the device once per size."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - step_started
    graphs = compiled_graphs()
    log.info("first compiled step at %d px (compilation included): %.1f s; compiled graphs "
             "so far: %d", size, seconds, graphs)
    logger.log_metrics(step, {"compile/first_step_s": seconds, "compile/graphs": graphs,
                              "train/image_size": size})

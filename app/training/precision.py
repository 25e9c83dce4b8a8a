"""Numerics on the training device: autocast dtype, memory format, fp16 loss scaling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.runtime.private_api import cpu_computes_bf16

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}


@dataclass(frozen=True)
class Precision:
    device: torch.device
    autocast_dtype: torch.dtype | None
    channels_last: bool
    input_dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(cls, amp: str, channels_last: bool, device: str, dtype: str = "float32"
                    ) -> "Precision":
        device = torch.device(device)
        on_cuda = device.type == "cuda"
        if amp == "auto":  # bf16 where the device computes it natively: ~1.4x fp32's steps on
            # a CPU with bf16 instructions (docs/results.md), slower than fp32 on one without
            amp = "bf16" if on_cuda or cpu_computes_bf16() else "off"
        # channels_last pays on CUDA tensor cores and with bf16 on a CPU (oneDNN's blocked
        # kernels); in fp32 on a CPU it only adds copies.
        autocast_dtype = AMP_DTYPES[amp]
        channels_last = channels_last and (on_cuda or autocast_dtype is torch.bfloat16)
        return cls(device, autocast_dtype, channels_last, getattr(torch, dtype))

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.autocast_dtype,
                              enabled=self.autocast_dtype is not None)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 needs loss scaling; bf16 has fp32's range and does not."""
        if self.autocast_dtype is torch.float16:
            return torch.amp.GradScaler(self.device.type)
        return None

    @property
    def fused_step(self) -> bool:
        """Whether SGD and AdamW step as one fused kernel: on CUDA, and under fp16 loss scaling
        anywhere, where the fused step takes the overflow check as a tensor and skips on the device
        instead of asking the host."""
        return self.device.type == "cuda" or self.autocast_dtype is torch.float16

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device, dtype=self.input_dtype)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

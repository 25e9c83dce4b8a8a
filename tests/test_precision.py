from pathlib import Path

import pytest
import torch

from app.data.device import ToDevice
from app.data.pipeline import InputFormat
from app.runtime.private_api import cpu_computes_bf16
from app.training import precision as precision_module
from app.training.precision import Precision


def test_cuda_defaults_to_bf16_and_channels_last():
    precision = Precision.from_config("auto", True, "cuda:0")
    assert precision.autocast_dtype is torch.bfloat16 and precision.channels_last
    assert precision.grad_scaler() is None or not torch.cuda.is_available()


def cpuinfo_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    return set(next(l for l in text.splitlines() if l.startswith("flags")).split(":")[1].split())


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads Linux's /proc/cpuinfo")
def test_bf16_instructions_are_found_as_the_kernel_lists_them():
    flags = cpuinfo_flags()
    assert cpu_computes_bf16() == bool({"avx512_bf16", "amx_tile"} & flags)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_a_cpu_defaults_to_bf16_in_channels_last_only_where_it_computes_bf16(
        monkeypatch, native_bf16):
    monkeypatch.setattr(precision_module, "cpu_computes_bf16", lambda: native_bf16)
    precision = Precision.from_config("auto", True, "cpu")
    assert precision.autocast_dtype is (torch.bfloat16 if native_bf16 else None)
    assert precision.channels_last is native_bf16 and precision.grad_scaler() is None
    full = Precision.from_config("off", True, "cpu")  # asked for: fp32, where copies only cost
    assert full.autocast_dtype is None and not full.channels_last
    model = precision.prepare_model(torch.nn.Conv2d(3, 8, 3))
    with precision.autocast():
        out = model(torch.rand(2, 3, 8, 8))
    assert out.dtype is (torch.bfloat16 if native_bf16 else torch.float32)


def test_fp16_uses_loss_scaling():
    assert Precision.from_config("fp16", True, "cpu").grad_scaler() is not None


@pytest.mark.gpu
def test_inputs_arrive_normalised_in_channels_last_on_the_gpu():
    precision = Precision.from_config("auto", True, "cuda:0")
    form = InputFormat(precision.device, precision.input_dtype, precision.channels_last)
    images, labels = ToDevice(form)(torch.randint(0, 256, (4, 16, 16, 3), dtype=torch.uint8),
                                    torch.arange(4))
    assert images.is_cuda and labels.is_cuda
    assert images.is_contiguous(memory_format=torch.channels_last)
    model = precision.prepare_model(torch.nn.Conv2d(3, 8, 3))
    with precision.autocast():
        assert model(images).dtype is torch.bfloat16

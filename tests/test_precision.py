import pytest
import torch

from app.data.device import ToDevice
from app.data.pipeline import InputFormat
from app.training.precision import Precision


def test_cuda_defaults_to_bf16_and_channels_last():
    precision = Precision.from_config("auto", True, "cuda:0")
    assert precision.autocast_dtype is torch.bfloat16 and precision.channels_last
    assert precision.grad_scaler() is None or not torch.cuda.is_available()


def test_cpu_defaults_to_full_precision_without_channels_last():
    precision = Precision.from_config("auto", True, "cpu")
    assert precision.autocast_dtype is None and not precision.channels_last
    assert precision.grad_scaler() is None


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

import pytest
import timm
import torch
import torch.nn as nn

from app.errors import UserError
from app.models import create_model


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_timm_models_by_name_have_plain_timm_keys(name):
    model = create_model(name, num_classes=7)
    reference = timm.create_model(name, num_classes=7)
    assert model.state_dict().keys() == reference.state_dict().keys()
    reference.load_state_dict(model.state_dict())  # strict: a plain timm model accepts it
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 7)


def test_small_variant_keeps_resolution_in_the_stem():
    small = create_model("resnet18_small", num_classes=10).eval()
    assert small.conv1.kernel_size == (3, 3) and small.conv1.stride == (1, 1)
    assert isinstance(small.maxpool, nn.Identity)
    features = small.forward_features(torch.randn(1, 3, 32, 32))
    assert features.shape[-1] == 4  # 32 / 8: only the three strided stages downsample
    plain = create_model("resnet18", num_classes=10).eval().forward_features(torch.randn(1, 3, 32, 32))
    assert plain.shape[-1] == 1
    assert small.state_dict().keys() == timm.create_model("resnet18").state_dict().keys()


def test_unknown_model_suggests_close_names():
    with pytest.raises(UserError, match=r"unknown model 'resnet5O'; did you mean .*resnet50"):
        create_model("resnet5O", num_classes=10)


def test_small_variant_needs_a_plain_resnet_stem():
    with pytest.raises(UserError, match="only for plain-stem ResNets"):
        create_model("resnet18d_small", num_classes=10)

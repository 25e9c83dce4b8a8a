import re

import pytest
import timm
import torch
import torch.nn as nn
from timm.layers import BlurPool2d, DropPath

from app.launch.run import main
from app.models.factory import create_model, parse_model_kwargs
from app.runtime.cli import run_cli
from app.runtime.errors import UserError
from conftest import TINY_TRAIN_FLAGS


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


@pytest.mark.parametrize("arch", ["torchvision.models.resnet.ResNet", "__main__.Net"])
def test_a_python_api_runs_model_class_is_named_with_how_to_load_it(arch):
    """app.train records the caller's class: predict, export and validate say what to do."""
    with pytest.raises(UserError, match=re.escape(f"'{arch}' is the model class of a run of "
                                                  "app.train, which can only be rebuilt in "
                                                  "Python")):
        create_model(arch, num_classes=10)
    assert create_model("resnet18.a1_in1k", num_classes=10).num_classes == 10  # a timm tag


def test_small_variant_needs_a_plain_resnet_stem():
    with pytest.raises(UserError, match="only for plain-stem ResNets"):
        create_model("resnet18d_small", num_classes=10)


# --- timm's options: --drop-path, --model-kwargs, zero-init -------------------------------

def blocks(model):
    return [block for stage in (model.layer1, model.layer2, model.layer3, model.layer4)
            for block in stage]


@pytest.mark.parametrize("name, norm", [("resnet18", "batch"), ("resnet18_small", "group")])
def test_drop_path_rate_reaches_every_block_rising_linearly(name, norm):
    model = create_model(name, num_classes=10, norm=norm, drop_path=0.1)
    rates = [block.drop_path.drop_prob if block.drop_path is not None else 0.0
             for block in blocks(model)]
    assert rates == pytest.approx([0.1 * i / 7 for i in range(8)])  # timm's linear rule
    assert all(isinstance(block.drop_path, DropPath) for block in blocks(model)[1:])
    assert not any(isinstance(m, DropPath) for m in create_model(name, 10, norm).modules())


def test_model_kwargs_are_python_literals_else_strings():
    assert parse_model_kwargs(["aa_layer=blurpool", "drop_rate=0.25", "zero_init_last=False",
                               "global_pool=None", "output_stride= 16"]) == {
        "aa_layer": "blurpool", "drop_rate": 0.25, "zero_init_last": False,
        "global_pool": None, "output_stride": 16}
    with pytest.raises(UserError, match="expected key=value, got 'blurpool'"):
        parse_model_kwargs(["blurpool"])


def test_aa_layer_blurpool_builds_timms_resnetblur():
    model = create_model("resnet18", 10, model_kwargs=parse_model_kwargs(["aa_layer=blurpool"]))
    reference = timm.create_model("resnetblur18", num_classes=10)
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    # after the stem's max-pool (stride 1 now) and in each strided block
    assert sum(isinstance(m, BlurPool2d) for m in model.modules()) == 4
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 10)
    by_name = create_model("resnetblur18", 10)  # timm's own blur models, by name
    assert sum(isinstance(m, BlurPool2d) for m in by_name.modules()) == 4


def test_aa_layer_with_the_small_variant_and_group_norm():
    model = create_model("resnet18_small", 10, "group", drop_path=0.05,
                         model_kwargs={"aa_layer": "blurpool"})
    assert isinstance(model.maxpool, nn.Identity)  # the small stem keeps full resolution
    assert sum(isinstance(m, BlurPool2d) for m in model.modules()) == 3  # layer2..4
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert model.forward_features(torch.randn(2, 3, 32, 32)).shape[-1] == 4


@pytest.mark.parametrize("kwargs, fragment", [
    ({"no_such_option": 1}, "model 'resnet18' has no option 'no_such_option'"),
    ({"aa_layer": "gaussian"}, "aa_layer=gaussian: unknown anti-aliasing layer"),
])
def test_a_wrong_model_kwarg_is_a_user_error_naming_it(kwargs, fragment):
    with pytest.raises(UserError, match=fragment):
        create_model("resnet18", 10, model_kwargs=kwargs)


def test_the_driver_says_which_model_kwarg_is_wrong(capsys, tmp_path, tiny_sample, catalog_for):
    code = run_cli(main, [*TINY_TRAIN_FLAGS, "--catalog", str(catalog_for(tiny_sample)),
                          "--output-dir", str(tmp_path), "--epochs", "1",
                          "--model-kwargs", "aa_layer=blurpool,no_such_option=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: ") and "'no_such_option'" in err[-1]


def last_norms(model):
    """Each residual block's last normalisation: bn2 of a BasicBlock, bn3 of a Bottleneck."""
    return [getattr(block, "bn3", block.bn2) for block in blocks(model)]


@pytest.mark.parametrize("name, norm", [("resnet18", "batch"), ("resnet50", "batch"),
                                        ("resnet18_small", "group")])
def test_each_blocks_last_norm_starts_at_zero(name, norm):
    """timm's zero_init_last: each residual branch starts at zero, each block as the identity."""
    model = create_model(name, 10, norm)
    assert all(torch.count_nonzero(n.weight) == 0 for n in last_norms(model))
    assert all(torch.count_nonzero(block.bn1.weight) > 0 for block in blocks(model))
    off = create_model(name, 10, norm, model_kwargs={"zero_init_last": False})
    assert all(torch.count_nonzero(n.weight) > 0 for n in last_norms(off))


# --- xse_resnext_mini: fastai's XResNet with one SE-ResNeXt block a stage -----------------

def test_xse_resnext_mini_has_the_mini_nets_shape():
    """pete88b's mini net: 3x3 stem of 32, 32, 64 channels; one block a stage of 64-512
    channels that widens 4x in a 64-group 3x3 convolution, returns in a full 3x3 one, then
    squeeze-and-excitation at 1/8; Mish; 12.9 M weights for 10 classes."""
    model = create_model("xse_resnext_mini", 10)
    assert [stem.conv.out_channels for stem in model.stem] == [32, 32, 64]
    assert [stem.conv.stride[0] for stem in model.stem] == [2, 1, 1]
    for index, (block, channels) in enumerate(zip(model.stages, (64, 128, 256, 512))):
        assert block.conv1.conv.groups == 64 and block.conv1.conv.out_channels == 4 * channels
        assert block.conv1.conv.kernel_size == block.conv2.conv.kernel_size == (3, 3)
        assert block.conv1.conv.stride[0] == (1 if index == 0 else 2)
        assert block.conv2.conv.groups == 1 and block.conv2.conv.out_channels == channels
        assert block.se.fc1.out_channels == channels // 8
        pools = [m for m in block.shortcut if isinstance(m, nn.AvgPool2d)]
        assert len(pools) == (0 if index == 0 else 1)
        assert len(block.shortcut) == (0 if index == 0 else 2)  # pool, then 1x1 projection
    acts = [m for m in model.modules() if isinstance(m, (nn.ReLU, nn.Mish))]
    assert acts and all(isinstance(m, nn.Mish) for m in acts)
    assert round(sum(p.numel() for p in model.parameters()) / 1e5) == 129
    assert model.forward_features(torch.randn(2, 3, 128, 128)).shape == (2, 512, 4, 4)
    assert model(torch.randn(2, 3, 128, 128)).shape == (2, 10)


def test_xse_resnext_mini_blocks_begin_as_the_identity():
    """fastai's BatchZero: each block's residual starts at zero, so at first a block is its
    shortcut followed by Mish; weights from Kaiming's normal (fan in)."""
    model = create_model("xse_resnext_mini", 10).eval()
    x = torch.randn(2, 64, 16, 16)
    assert torch.equal(model.stages[0](x), nn.functional.mish(x))
    second = model.stages[1]
    assert torch.equal(second(x), nn.functional.mish(second.shortcut(x)))
    weight = model.stages[3].conv2.conv.weight  # 512 x 2048 x 3 x 3
    expected = (2 / weight[0].numel()) ** 0.5
    assert abs(weight.std().item() / expected - 1) < 0.01
    assert torch.count_nonzero(model.stages[3].se.fc1.bias) == 0


def test_xse_resnext_mini_takes_a_new_head_and_names_what_it_refuses():
    model = create_model("xse_resnext_mini", 10)
    model.reset_classifier(3)
    assert model.get_classifier().out_features == 3 and model.num_classes == 3
    with pytest.raises(UserError, match="'xse_resnext_mini' does not accept norm = 'group'"):
        create_model("xse_resnext_mini", 10, "group")
    with pytest.raises(UserError, match="'xse_resnext_mini' has no option 'aa_layer'"):
        create_model("xse_resnext_mini", 10, model_kwargs={"aa_layer": "blurpool"})

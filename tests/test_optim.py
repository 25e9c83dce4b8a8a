import math

import numpy as np
import pytest
import torch

from app.config import OptimConfig
from app.config.sources import parse_config
from app.models.factory import create_model
from app.runtime.errors import UserError
from app.training.optim import (WarmupSchedule, build_optimizer, build_scheduler, clip_gradients,
                                param_groups, restore_scheduler, scaled_lr)


def test_no_weight_decay_on_norm_and_bias_parameters():
    model = create_model("resnet18", num_classes=10)
    decay, no_decay = param_groups(model, 1e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert "layer2.0.downsample.1.weight" in no_decay_names  # a BatchNorm not called "bn"
    assert {"fc.bias", "bn1.weight", "bn1.bias"} <= no_decay_names
    assert {"conv1.weight", "fc.weight", "layer2.0.downsample.0.weight"} <= decay_names
    assert all(names[id(p)].endswith("weight") and p.ndim > 1 for p in decay["params"])
    assert len(decay_names) + len(no_decay_names) == len(names)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (1e-4, 0.0)


def test_lr_is_per_256_images():
    config = OptimConfig(lr=0.1)
    assert scaled_lr(config, 1024) == pytest.approx(0.4)
    optimizer = build_optimizer(torch.nn.Linear(2, 2), config, global_batch=128)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_nesterov_and_adamw():
    sgd = build_optimizer(torch.nn.Linear(2, 2), OptimConfig(nesterov=True), 256)
    assert sgd.param_groups[0]["nesterov"] is True
    adamw = build_optimizer(torch.nn.Linear(2, 2), OptimConfig(optimizer="adamw",
                                                               momentum=0.8), 256)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["betas"][0] == 0.8


def test_warmup_then_cosine():
    schedule = WarmupSchedule(OptimConfig(warmup_epochs=2), steps_per_epoch=10, epochs=12)
    assert schedule(0) == pytest.approx(1 / 20) and schedule(9) == pytest.approx(10 / 20)
    assert schedule(19) == pytest.approx(1.0)
    assert schedule(20) == pytest.approx(1.0)
    assert schedule(70) == pytest.approx(0.5)  # half way through the 100 cosine steps
    assert schedule(119) == pytest.approx(0.5 * (1 + math.cos(math.pi * 99 / 100)))
    factors = [schedule(s) for s in range(20, 120)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))


def test_poly_schedule_is_mlperfs_polynomial_decay_to_the_end_lr():
    """MLPerf's LARS schedule after its warmup: end + (base - end) x (1 - t / D)^2 with D the
    steps after the warmup plus one; torch's PolynomialLR computes the (base - end) part."""
    model = torch.nn.Linear(4, 2)
    config = OptimConfig(optimizer="lars", schedule="poly", lr=0.1, warmup_epochs=1,
                         lr_min=1e-3)
    ours = build_scheduler(build_optimizer(model, config, 256), config, 10, epochs=5)
    reference_optimizer = torch.optim.SGD(model.parameters(), lr=0.1 - 1e-3)
    reference = torch.optim.lr_scheduler.PolynomialLR(reference_optimizer, total_iters=41,
                                                      power=2.0)
    seen = lrs(ours, 50)
    assert seen[:10] == pytest.approx([0.1 * (s + 1) / 10 for s in range(10)])  # the warmup
    assert seen[10:] == pytest.approx([1e-3 + lr for lr in lrs(reference, 40)], rel=1e-9)
    assert seen[10] == pytest.approx(0.1) and seen[-1] < 2e-3


def test_step_schedule():
    schedule = WarmupSchedule(OptimConfig(schedule="step", warmup_epochs=0, step_epochs=3,
                                          step_gamma=0.1), steps_per_epoch=5, epochs=9)
    assert [schedule(s) for s in (0, 14, 15, 29, 30)] == pytest.approx([1, 1, 0.1, 0.1, 0.01])


def run_steps(scheduler, steps):
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()


def test_a_resume_keeps_the_position_and_follows_the_current_schedule():
    model = create_model("test_resnet", 10)
    config = OptimConfig(warmup_epochs=0)
    short = build_scheduler(build_optimizer(model, config, 256), config, 10, epochs=1)
    run_steps(short, 7)
    same = build_scheduler(build_optimizer(model, config, 256), config, 10, epochs=1)
    restore_scheduler(same, short.state_dict())
    assert same.last_epoch == 7
    assert same.optimizer.param_groups[0]["lr"] == short.optimizer.param_groups[0]["lr"]
    # Resumed with --epochs 2: the cosine is stretched, not left at the old end.
    run_steps(short, 3)
    assert short.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
    longer = build_scheduler(build_optimizer(model, config, 256), config, 10, epochs=2)
    restore_scheduler(longer, short.state_dict())
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clipping_scales_gradients_to_the_global_norm(max_norm):
    model = create_model("test_resnet", 10)
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = [p.grad.clone() for p in model.parameters()]
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in before))  # ~ sqrt(#params)
    optimizer = build_optimizer(model, OptimConfig(), 256)
    clip_gradients(optimizer, max_norm)
    factor = min(1.0, max_norm / norm)
    for p, g in zip(model.parameters(), before):
        assert torch.allclose(p.grad, g * factor, rtol=1e-5, atol=0)
    clipped = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
    assert clipped == pytest.approx(min(norm, max_norm), rel=1e-5)


def lrs(scheduler, steps):
    seen = []
    for _ in range(steps):
        seen.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("method", ["linear", "constant"])
def test_torchvisions_warmup_and_cosine_floor(method):
    """torchvision's references: LinearLR/ConstantLR for the warmup epochs, then
    CosineAnnealingLR to eta_min, one scheduler step per epoch (here one step per epoch)."""
    model = create_model("test_resnet", 10)
    config = OptimConfig(lr=0.5, warmup_epochs=3, lr_warmup_method=method,
                         lr_warmup_decay=0.01, lr_min=0.001)
    ours = build_scheduler(build_optimizer(model, config, 256), config, 1, epochs=12)
    reference_optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    first = (torch.optim.lr_scheduler.LinearLR(reference_optimizer, start_factor=0.01,
                                               total_iters=3) if method == "linear" else
             torch.optim.lr_scheduler.ConstantLR(reference_optimizer, factor=0.01,
                                                 total_iters=3))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(reference_optimizer, T_max=9,
                                                        eta_min=0.001)
    reference = torch.optim.lr_scheduler.SequentialLR(reference_optimizer, [first, cosine],
                                                      milestones=[3])
    assert lrs(ours, 12) == pytest.approx(lrs(reference, 12), rel=1e-9, abs=1e-12)


def test_ffcvs_schedule_step_by_step():
    """FFCV's train_imagenet.py: get_cyclic_lr per epoch (np.interp over [0, peak, epochs]),
    then within each epoch np.interp between this epoch's and the next one's LR."""
    model = create_model("test_resnet", 10)
    config = OptimConfig(lr=1.7 * 256 / 4096, schedule="ffcv", lr_peak_epoch=2)
    epochs, iters = 6, 7
    ours = build_scheduler(build_optimizer(model, config, 4096), config, iters, epochs=epochs)
    lr = 1.7

    def cyclic(epoch):
        return np.interp([epoch], [0, 2, epochs], [1e-4 * lr, lr, 0])[0]
    expected = [value for epoch in range(epochs) for value in
                np.interp(np.arange(iters), [0, iters], [cyclic(epoch), cyclic(epoch + 1)])]
    assert lrs(ours, epochs * iters) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_a_constant_warmup_without_a_factor_is_refused():
    with pytest.raises(UserError, match="needs --lr-warmup-decay"):
        parse_config(["--lr-warmup-method", "constant"])


def test_norm_and_bias_weight_decay_flags_make_their_own_groups():
    model = create_model("resnet18", num_classes=10)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, norm, bias = param_groups(model, 1e-4, norm_weight_decay=0.0, bias_weight_decay=2e-5)
    assert {names[id(p)] for p in bias["params"]} == {"fc.bias"}
    assert "bn1.bias" in {names[id(p)] for p in norm["params"]}
    assert [g["weight_decay"] for g in (decay, norm, bias)] == [1e-4, 0.0, 2e-5]
    # the same decay for both: one group, as in earlier checkpoints
    assert len(param_groups(model, 1e-4, 1e-5, 1e-5)) == 2


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_lars_and_lamb_adapt_only_the_decayed_weights(name):
    """One step from the same gradients: norm and bias parameters move exactly as the plain
    rule moves them (SGD with momentum for LARS, Adam for LAMB: no trust ratio), weights do
    not (their step is scaled by ||w|| / ||update||)."""
    torch.manual_seed(0)
    model = create_model("test_resnet", 10).double()  # float64: exact small differences
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-4  # global norm < 1: LAMB's clip leaves it alone
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = OptimConfig(optimizer=name, lr=0.1, weight_decay=1e-4)
    optimizer = build_optimizer(model, config, 256)
    assert type(optimizer).__name__ == name.capitalize()
    optimizer.step()
    lr = scaled_lr(config, 256)
    decay, no_decay = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    for p in no_decay["params"]:
        g = p.grad
        plain = g if name == "lars" else g / (g.abs() + 1e-6)  # Adam's first step
        assert torch.allclose(start[names[id(p)]] - p.detach(), lr * plain, rtol=1e-4,
                              atol=1e-12), names[id(p)]
    adapted = [p for p in decay["params"] if not torch.allclose(
        start[names[id(p)]] - p.detach(), lr * (p.grad if name == "lars" else
                                                p.grad / (p.grad.abs() + 1e-6)),
        rtol=1e-2, atol=0)]
    assert len(adapted) == len(decay["params"])


def test_ranger_is_radam_pulled_half_way_back_every_sixth_step():
    """Ranger: RAdam steps (decoupled weight decay on weights only), and every sixth step the
    weights go half way back to where the six began. timm's Lookahead takes its first slow
    weights at step 6 (fastai's at step 0): the first pull back is at step 12."""
    torch.manual_seed(0)
    model = create_model("test_resnet", 10).double()
    grads = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(12)]
    config = OptimConfig(optimizer="ranger", lr=0.04, momentum=0.95, weight_decay=1e-2)
    ranger = build_optimizer(model, config, 64)
    reference = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    decayed = {id(p) for p in ranger.param_groups[0]["params"]}
    radam = torch.optim.RAdam(
        [{"params": [reference[n] for n, p in model.named_parameters() if id(p) in decayed],
          "weight_decay": 1e-2},
         {"params": [reference[n] for n, p in model.named_parameters() if id(p) not in decayed],
          "weight_decay": 0.0}], lr=0.01, betas=(0.95, 0.99), eps=1e-6,
        decoupled_weight_decay=True)
    for step, grad in enumerate(grads, start=1):
        for n, p in model.named_parameters():
            p.grad = grad[n].clone()
            reference[n].grad = grad[n].clone()
        ranger.step()
        radam.step()
        if step < 12:  # until then the weights are RAdam's
            assert all(torch.allclose(p, reference[n]) for n, p in model.named_parameters())
        if step == 6:
            slow = {n: p.detach().clone() for n, p in reference.items()}
    for n, p in model.named_parameters():
        assert torch.allclose(p, slow[n] + 0.5 * (reference[n] - slow[n])), n
        assert not torch.allclose(p, reference[n]), n
    assert ranger.param_groups[0]["weight_decay"] == 1e-2 and len(decayed) > 0

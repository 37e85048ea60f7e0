"""train's optimizer step: fused AdamW over clipped gradients with a device-side norm and guard,
against a float64 AdamW with megatron's clipping, to a bound derived from float32 rounding
(``support.adamw_reference``); train's previous path (megatron's
``optimizer.step()`` semantics, ``CPUOptimizer.step``) meets the same bound; planted mistakes do
not; a non-finite step changes nothing."""

from __future__ import annotations

import math

import pytest
import torch
from support.adamw_reference import EXACT, adamw_float64, gamma, rounding_bound

from megatron_hybrid.training.optimizer_step import apply_step, guard_statistics, use_fused_adam
from megatron_hybrid.training.optimizers import CPUOptimizer

CLIP = EXACT.clip
SHAPES = ((48, 32), (32,), (8, 4, 16))  # the last one an expert weight (allreduce False)
ELEMENTS = sum(math.prod(shape) for shape in SHAPES)


class Params(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES
        )
        self.weights[2].allreduce = False


def _grads(seed: int = 1) -> list[list[torch.Tensor]]:
    """Gradients of six steps; norms from about 0.3 to 12 (clipped and not)."""
    generator = torch.Generator().manual_seed(seed)
    scales = (4.0, 0.05, 1.5, 0.1, 2.0, 0.08)
    return [
        [scale * torch.randn(shape, generator=generator) for shape in SHAPES] for scale in scales
    ]


def _optimizer(module, pg, fused: bool = True, clip: float = CLIP) -> CPUOptimizer:
    optimizer = CPUOptimizer(
        [module], lr=EXACT.lr, weight_decay=EXACT.weight_decay, clip_grad=clip, pg_collection=pg
    )
    for group in optimizer.optimizer.param_groups:
        group.update(betas=EXACT.betas, eps=EXACT.eps)
    if fused:
        assert use_fused_adam(optimizer) is None
    return optimizer


def _fused_step(optimizer, grads, clip: float = CLIP):
    for param, grad in zip(optimizer.params, grads, strict=True):
        param.main_grad = grad.clone()
    stats = guard_statistics(optimizer, torch.zeros(2, dtype=torch.float64))
    apply_step(optimizer, stats, clip)
    return stats


def _within_bound(module, steps) -> list[bool]:
    """Per parameter, whether it is within the rounding bound of the float64 oracle."""
    exact, trajectory = adamw_float64(Params().weights, steps, EXACT)
    bounds = rounding_bound(trajectory, ELEMENTS, EXACT)
    return [
        bool(((param.double() - reference).abs() <= bound).all())
        for param, reference, bound in zip(module.weights, exact, bounds, strict=True)
    ]


@pytest.fixture
def steps():
    return _grads()


def test_fused_step_matches_float64_adamw_within_the_rounding_bound(pg, steps):
    module = Params()
    optimizer = _optimizer(module, pg)
    norms = [float(_fused_step(optimizer, grads).grad_norm) for grads in steps]
    assert all(_within_bound(module, steps))
    expected = [math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)) for grads in steps]
    assert norms == pytest.approx(expected, rel=gamma(ELEMENTS))
    assert optimizer.optimizer.param_groups[0]["fused"] is True


def test_previous_path_is_within_the_same_bound(pg, steps):
    """train's previous CPU path (float64 norm, unfused AdamW) meets the bound too: both are
    float32 roundings of one computation."""
    module = Params()
    optimizer = _optimizer(module, pg, fused=False)
    for grads in steps:
        for param, grad in zip(optimizer.params, grads, strict=True):
            param.main_grad = grad.clone()
        optimizer.step()
    assert all(_within_bound(module, steps))


@pytest.mark.parametrize(
    "bug",
    [
        pytest.param("no-clip", id="clip-not-applied"),
        pytest.param("no-weight-decay", id="weight-decay-lost"),
    ],
)
def test_negative_control_a_planted_mistake_exceeds_the_bound(pg, steps, bug):
    module = Params()
    clip = 0.0 if bug == "no-clip" else CLIP
    optimizer = _optimizer(module, pg, clip=clip)
    if bug == "no-weight-decay":
        optimizer.optimizer.param_groups[0]["weight_decay"] = 0.0
    for grads in steps:
        _fused_step(optimizer, grads, clip=clip)
    assert not all(_within_bound(module, steps))


def test_unclipped_gradients_are_untouched_bitwise(pg):
    """A norm below the clip: the factor is exactly 1, as megatron skips the scaling."""
    module = Params()
    optimizer = _optimizer(module, pg)
    grads = [0.002 * g for g in _grads()[0]]
    for param, grad in zip(optimizer.params, grads, strict=True):
        param.main_grad = grad.clone()
    stats = guard_statistics(optimizer, torch.zeros(2, dtype=torch.float64))
    assert float(stats.grad_norm) < CLIP
    apply_step(optimizer, stats, CLIP)
    for param, grad in zip(optimizer.params, grads, strict=True):
        assert torch.equal(param.grad, grad)


@pytest.mark.parametrize(
    ("where", "value"),
    [
        pytest.param("gradient", float("nan"), id="nan-gradient"),
        pytest.param("gradient", float("inf"), id="inf-gradient"),
        pytest.param("loss", float("nan"), id="nan-loss"),
    ],
)
def test_a_flagged_step_changes_nothing_and_keeps_the_culprit(pg, steps, where, value):
    """The fused kernel skips the update on the device; parameters, moments and step counts
    stay bitwise, and the gradients stay as they were (the NaN can still be found by name)."""
    module = Params()
    optimizer = _optimizer(module, pg)
    _fused_step(optimizer, steps[0])
    inner = optimizer.optimizer
    before = [p.detach().clone() for p in module.weights]
    state = {id(p): {k: v.clone() for k, v in inner.state[p].items()} for p in module.weights}
    grads = [g.clone() for g in steps[1]]
    loss = torch.zeros(2, dtype=torch.float64)
    if where == "gradient":
        grads[1][3] = value
    else:
        loss[0] = value
    for param, grad in zip(optimizer.params, grads, strict=True):
        param.main_grad = grad.clone()
    stats = guard_statistics(optimizer, loss)
    apply_step(optimizer, stats, CLIP)
    assert bool(stats.nonfinite)
    for param, old in zip(module.weights, before, strict=True):
        assert torch.equal(param.detach(), old)
        for key, saved in state[id(param)].items():
            assert torch.equal(inner.state[param][key], saved), key
    for param, grad in zip(optimizer.params, grads, strict=True):
        assert torch.allclose(param.main_grad, grad, rtol=0, atol=0, equal_nan=True)
    # The control: the next finite step updates again.
    _fused_step(optimizer, steps[2])
    assert not torch.equal(module.weights[0].detach(), before[0])

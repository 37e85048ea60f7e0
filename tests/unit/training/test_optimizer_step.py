"""train's optimizer step: fused AdamW over clipped gradients with a device-side norm and guard,
against a float64 AdamW with megatron's clipping, to a bound derived from float32 rounding
(``support.adamw_reference``); train's previous path (megatron's
``optimizer.step()`` semantics, ``CPUOptimizer.step``) meets the same bound; planted mistakes do
not; a non-finite step changes nothing."""

from __future__ import annotations

import math

import pytest
import torch
from support.adamw_reference import (
    DEFERRED_ROUNDINGS,
    EXACT,
    adamw_float64,
    gamma,
    gradient_error,
    rounding_bound,
)

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


def _within_bound(module, steps, extra_roundings: int = 0) -> list[bool]:
    """Per parameter, whether it is within the rounding bound of the float64 oracle."""
    exact, trajectory = adamw_float64(Params().weights, steps, EXACT)
    bounds = rounding_bound(trajectory, ELEMENTS, EXACT, extra_roundings)
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


TOKENS = (pytest.param(4096, id="power-of-two-tokens"), pytest.param(3001, id="rounded-factor"))


def _deferred_step(optimizer, grads, tokens: int, *, bug: str | None = None, clip: float = CLIP):
    """A step as ``train_step`` takes it with the token count's factor deferred: the main grads
    hold the unscaled sums (``grads * tokens`` in float32), the guard and the step get
    ``1 / tokens``. Returns the statistics and the float64 gradients the step stands for."""
    sums = [g * tokens for g in grads]
    for param, total in zip(optimizer.params, sums, strict=True):
        param.main_grad = total.clone()
    scaling = torch.tensor(1.0) / tokens  # float32, as finalize_model_grads makes it
    if bug == "factor-twice":  # applied by the buffers too, then deferred
        for param in optimizer.params:
            param.main_grad.mul_(scaling)
    stats = guard_statistics(optimizer, torch.zeros(2, dtype=torch.float64), scaling)
    if bug == "factor-dropped":
        stats.scaling = None
    apply_step(optimizer, stats, clip)
    return stats, [total.double() / tokens for total in sums]


def _scaled_and_clipped(optimizer, exact, norm: float, clip: float = CLIP) -> bool:
    """Whether the gradients the step used (the fused kernel stores them back; megatron leaves
    them so too) are the float64 ones times the clip factor, within their rounding."""
    factor = min(1.0, clip / (norm + 1e-6))
    delta = gradient_error(ELEMENTS, DEFERRED_ROUNDINGS)
    return all(
        bool(((p.grad.double() - e * factor).abs() <= delta * (e * factor).abs()).all())
        for p, e in zip(optimizer.params, exact, strict=True)
    )


@pytest.mark.parametrize("tokens", TOKENS)
def test_deferred_token_factor_is_applied_by_the_fused_kernel(pg, steps, tokens):
    """``train_step``'s fused path: the division by the token count and the clip factor go to
    torch's fused AdamW as one ``grad_scale``; the norm is the scaled gradients', the update
    within the float64 oracle's rounding bound (plus the factor's roundings), and the gradients
    left are megatron's (scaled, then clipped)."""
    module = Params()
    optimizer = _optimizer(module, pg)
    exact_steps = []
    for grads in steps:
        stats, exact = _deferred_step(optimizer, grads, tokens)
        exact_steps.append(exact)
        norm = math.sqrt(sum(float(e.pow(2).sum()) for e in exact))
        assert float(stats.grad_norm) == pytest.approx(norm, rel=gradient_error(ELEMENTS, 2))
        assert _scaled_and_clipped(optimizer, exact, norm)
        assert not hasattr(optimizer.optimizer, "grad_scale")  # handed over for one step only
    assert all(_within_bound(module, exact_steps, DEFERRED_ROUNDINGS))


@pytest.mark.parametrize(
    "bug",
    [pytest.param("factor-dropped", id="factor-dropped"), pytest.param("factor-twice", id="twice")],
)
def test_negative_control_a_lost_or_doubled_token_factor_is_caught(pg, steps, bug):
    """AdamW hardly sees a gradient's scale (its update is ``m / sqrt(v)``), so the check that
    catches a lost or doubled factor is the gradients' (and the norm's); both fail here."""
    optimizer = _optimizer(Params(), pg)
    stats, exact = _deferred_step(optimizer, steps[0], 3001, bug=bug)
    norm = math.sqrt(sum(float(e.pow(2).sum()) for e in exact))
    assert not _scaled_and_clipped(optimizer, exact, norm)
    if bug == "factor-twice":
        assert float(stats.grad_norm) != pytest.approx(norm, rel=0.5)


def test_deferred_factor_multiplies_where_the_kernel_cannot_take_it(pg, steps):
    """SGD (no fused kernel) gets the factor in one multiply before its step: the same update as
    megatron's order (scale, then clip, then step) within a few roundings."""
    deferred = CPUOptimizer([Params()], lr=0.1, weight_decay=0.01, clip_grad=CLIP,
                            pg_collection=pg, optimizer="sgd")  # fmt: skip
    eager_module = Params()
    eager = CPUOptimizer([eager_module], lr=0.1, weight_decay=0.01, clip_grad=CLIP,
                         pg_collection=pg, optimizer="sgd")  # fmt: skip
    assert use_fused_adam(deferred) is not None
    for grads in steps[:3]:
        _, exact = _deferred_step(deferred, grads, 3001)
        for param, e in zip(eager.params, exact, strict=True):
            param.main_grad = e.float()
        eager.step()
    for ours, theirs in zip(deferred.params, eager.params, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_separate_norm_groups_each_get_their_own_factor(pg, steps):
    """Gradients in two norm groups (as megatron's MTP depths) are clipped by their own norms:
    the factor cannot be one ``grad_scale``, so each group is multiplied by its own."""

    class TwoNorms(CPUOptimizer):
        def norm_groups(self):
            dense, expert = super().norm_groups()
            expert.name = "mtp-1"
            return [dense, expert]

    optimizer = TwoNorms([Params()], lr=EXACT.lr, weight_decay=EXACT.weight_decay,
                         clip_grad=CLIP, pg_collection=pg)  # fmt: skip
    assert use_fused_adam(optimizer) is None
    stats, exact = _deferred_step(optimizer, steps[0], 3001)
    assert len(stats.norms) == 2
    groups = ([0, 1], [2])  # the expert weight is the MTP group here
    for norm, members in zip(stats.norms, groups, strict=True):
        expected = math.sqrt(sum(float(exact[i].pow(2).sum()) for i in members))
        assert float(norm) == pytest.approx(expected, rel=gradient_error(ELEMENTS, 2))
        factor = min(1.0, CLIP / (expected + 1e-6))
        for i in members:
            got = optimizer.params[i].grad.double()
            assert ((got - exact[i] * factor).abs()
                    <= gradient_error(ELEMENTS, DEFERRED_ROUNDINGS) * (exact[i] * factor).abs()
                    ).all()  # fmt: skip

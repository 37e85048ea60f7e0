"""The float32 rounding-scale estimator the numerical tests take their bounds from.

The scale of a well-conditioned result is a few unit roundoffs; a cancelling one (a small
difference of large terms) is larger by the cancellation factor, as error analysis says; views
and in-place updates keep their aliasing under the jitter; the scale does not depend on the
machine's own float32 rounding (the same numbers from float64 inputs).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from rounding import FLOAT32_U, RoundingJitter, float32_bounds, float32_error_scale, max_abs


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_well_conditioned_product_has_a_few_roundings():
    x = torch.rand(64, generator=torch.Generator().manual_seed(0)) + 1

    def evaluate(rounding):
        with rounding:
            return {"y": (x * 3) * 2}  # two roundings, condition number 1

    scale = float32_error_scale(evaluate, measure=_relative)["y"]
    assert FLOAT32_U / 2 < scale < 3 * FLOAT32_U


def test_cancellation_raises_the_scale_by_its_factor():
    big = torch.full((16,), 1000.0)

    def evaluate(rounding):
        with rounding:
            return {"small": (big + 1) - big}  # exact 1, from terms 1000x larger

    scale = float32_error_scale(evaluate, measure=_relative)["small"]
    assert 100 * FLOAT32_U < scale < 10_000 * FLOAT32_U


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_scale_does_not_depend_on_float32_rounding(dtype):
    weights = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))

    def evaluate(rounding):
        w = weights.to(dtype)
        with rounding:
            return {"y": (w @ w).tanh().sum(0)}

    scale = float32_error_scale(evaluate, measure=max_abs)["y"]
    reference = float32_error_scale(
        lambda rounding: {"y": _double_run(weights, rounding)}, measure=max_abs
    )["y"]
    assert scale == pytest.approx(reference, rel=0.05)


def _double_run(weights, rounding):
    w = weights.double()
    with rounding:
        return (w @ w).tanh().sum(0)


def test_views_and_in_place_updates_keep_their_aliasing():
    x = torch.zeros(4, 4)
    with RoundingJitter(2.0**-16, seed=0):
        row = x[1]  # a view: not replaced
        row.add_(1.0)  # in place: updates x through the view
        y = x.sum()
    assert torch.equal(x[1], torch.ones(4)) and x[0].abs().sum() == 0
    assert y.item() != 4.0  # the reduction's result is jittered


def test_bounds_never_go_below_the_floor():
    def evaluate(rounding):
        with rounding or contextlib.nullcontext():
            return {"one": torch.ones(3) * 2}

    assert float32_bounds(evaluate, measure=max_abs, floor=1e-3) == {"one": 1e-3}

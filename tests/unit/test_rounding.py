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
from rounding import (
    FLOAT32_U,
    RoundingJitter,
    bounds_of,
    float32_bounds,
    float32_error_scale,
    max_abs,
    outside,
)


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


def test_bounds_of_a_pure_computation_are_float32_bounds_of_it():
    """``bounds_of`` runs the whole computation in the rounding, as an ``evaluate`` would."""
    big = torch.full((16,), 1000.0)

    def evaluate(rounding):
        with rounding:
            return {"small": (big + 1) - big}

    expected = float32_bounds(evaluate, measure=_relative, floor=0.0)
    assert bounds_of(lambda: {"small": (big + 1) - big}, measure=_relative, floor=0.0) == expected
    assert expected["small"] > 100 * FLOAT32_U  # the cancellation's, not a floor


def test_outside_names_each_result_past_its_bound_and_a_nan():
    reference = {"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(4)}
    results = {"a": torch.ones(4), "b": torch.full((4,), 1.5), "c": torch.full((4,), float("nan"))}
    over = outside(results, reference, {"a": 0.0, "b": 0.4, "c": 1.0}, max_abs)
    assert [name for name, *_ in over] == ["b", "c"]
    assert over[0] == ("b", 0.5, 0.4)

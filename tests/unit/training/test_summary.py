"""train's closing line: median step time and tokens/s after warm-up, the warm-up apart."""

from __future__ import annotations

import pytest

from megatron_hybrid.cli.train import closing_line
from megatron_hybrid.training.metrics import TrainingSummary


def _summary(seconds, tokens, saved=None) -> TrainingSummary:
    return TrainingSummary(
        first_iteration=0,
        last_iteration=len(seconds),
        losses=[5.0 - 0.1 * i for i in range(len(seconds))],
        grad_norms=[1.0] * len(seconds),
        saved=saved,
        step_seconds=list(seconds),
        step_tokens=list(tokens),
    )


def test_warmup_is_left_out_of_the_throughput():
    """A 105 s autotuning first step and 69.5 ms steps after it: ~4,700 tok/s, not 49."""
    summary = _summary([105.0, 0.0695, 0.070, 0.069, 0.0695], [330] * 5, saved="ckpt/iter_5")
    assert summary.median_step_seconds == pytest.approx(0.0695)
    assert summary.tokens_per_second == pytest.approx(330 / 0.0695)
    assert closing_line(summary) == (
        "done: 5 steps (0->5) | loss 5.0000 -> 4.6000 | median step 69.5 ms, 4,748 tok/s | "
        "warm-up 105.00 s | saved ckpt/iter_5"
    )
    # The negative control: averaging every step, warm-up included, gives the misleading rate.
    assert sum(summary.step_tokens) / sum(summary.step_seconds) < 16


def test_median_is_robust_to_one_slow_step():
    summary = _summary([3.0, 0.1, 0.1, 2.0, 0.1], [100] * 5)
    assert summary.median_step_seconds == pytest.approx(0.1)
    assert summary.tokens_per_second == pytest.approx(1000)


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        pytest.param([1.5], "done: 1 steps (0->1) | loss 5.0000 -> 5.0000 | warm-up 1.50 s, no "
                     "later step to time", id="one-step"),
        pytest.param([], "done: 0 steps (0->0) | loss nan -> nan", id="no-step"),
    ],
)  # fmt: skip
def test_short_runs_say_what_they_can(seconds, expected):
    assert closing_line(_summary(seconds, [64] * len(seconds))) == expected

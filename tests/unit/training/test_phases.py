"""The phase timer: exclusive times of nested phases that, with ``host``, sum to the step; each
phase waits for the device; train's step reports its phases only when given a timer."""

from __future__ import annotations

import pytest

from megatron_hybrid.training.phases import HOST, PHASES, PhaseTimer


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_nested_phases_keep_their_own_time_and_sum_to_the_step():
    clock, waits = FakeClock(), []
    timer = PhaseTimer(lambda: waits.append(clock.now), clock=clock)
    with timer.step():
        clock.advance(1.0)  # host work outside every phase
        with timer.phase("data"):
            clock.advance(2.0)
        with timer.phase("forward-backward"):
            clock.advance(3.0)
            with timer.phase("gradient finalisation"):
                clock.advance(4.0)
            clock.advance(5.0)
        timer.wrap("optimizer", clock.advance)(6.0)
    assert timer.breakdown() == {
        "data": 2.0, "forward-backward": 8.0, "gradient finalisation": 4.0, "optimizer": 6.0,
        HOST: 1.0,
    }  # fmt: skip
    assert sum(timer.breakdown().values()) == timer.step_seconds == 21.0
    # A wait at both ends of the step and of each of the four phases.
    assert len(waits) == 2 + 2 * 4


def test_breakdown_is_per_step():
    clock = FakeClock()
    timer = PhaseTimer(lambda: None, clock=clock)
    for seconds in (1.0, 3.0):
        with timer.step(), timer.phase("guard"):
            clock.advance(seconds)
    assert timer.breakdown() == {"guard": 2.0, HOST: 0.0}


@pytest.fixture
def tiny(pg):
    from step_setup import tiny_training

    return tiny_training(pg)


def test_train_step_phases_sum_to_the_step(tiny, pg):
    """train's own step on the CPU: every phase shows and they add up to the step's time."""
    from step_setup import step

    waits = []
    timer = PhaseTimer(lambda: waits.append(1))
    with timer.step():
        with timer.phase("data"):
            batches = tiny.batches(0)
        result = step(tiny, pg, batches, timer=timer)
    assert result.finite and result.tokens == sum(b["num_tokens"] for b in batches)
    breakdown = timer.breakdown()
    assert list(breakdown) == [*PHASES, HOST]
    assert all(seconds > 0 for name, seconds in breakdown.items() if name != HOST)
    assert sum(breakdown.values()) == pytest.approx(timer.step_seconds, rel=1e-12)
    assert len(waits) == 2 * (len(PHASES) + 1)

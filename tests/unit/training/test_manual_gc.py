"""``train --manual-gc``: no automatic garbage collection inside a step, collections between.

The collector's schedule on its own (disabled inside, restored after, a full collection on
entering, after every ``--manual-gc-interval``-th iteration and around each evaluation), then in
a real ``train`` run on the CPU, with a run without the flag as the control: there Python's
automatic collection stays on inside the steps and nothing is collected by hand.
"""

from __future__ import annotations

import gc

import pytest

from megatron_hybrid.testing.spawn import run_distributed
from megatron_hybrid.training.collection import ManualCollection


@pytest.fixture
def counted(monkeypatch):
    """Calls of ``gc.collect`` (generation of each), the collector left running as found."""
    calls: list[int] = []
    real = gc.collect

    def collect(generation: int = 2) -> int:
        calls.append(generation)
        return real(generation)

    monkeypatch.setattr(gc, "collect", collect)
    was = gc.isenabled()
    yield calls
    if was:
        gc.enable()


@pytest.mark.parametrize(
    ("interval", "around_eval", "expected"),
    [
        pytest.param(2, True, [2, 2, 2, 0], id="interval-2-and-eval"),
        pytest.param(0, True, [2, 2, 0], id="eval-only"),
        pytest.param(3, False, [2], id="interval-3-no-eval"),
    ],
)
def test_schedule(counted, interval, around_eval, expected):
    gc.enable()
    with ManualCollection(True, interval, around_eval) as collector:
        assert not gc.isenabled()
        for done in (1, 2):
            collector.after_step(done)
        collector.before_eval()
        collector.after_eval()
    assert gc.isenabled()
    assert counted == expected and collector.collections == len(expected)


def test_off_changes_nothing(counted):
    gc.enable()
    with ManualCollection(False, 2) as collector:
        assert gc.isenabled()
        collector.after_step(2)
        collector.before_eval()
    assert gc.isenabled() and counted == []


def test_a_disabled_collector_stays_disabled(counted):
    gc.disable()
    with ManualCollection(True, 1):
        pass
    assert not gc.isenabled()


def test_negative_interval_is_refused():
    with pytest.raises(ValueError, match=r"--manual-gc-interval -1 must be >= 0"):
        ManualCollection(True, -1)


def _train_worker(rank: int, world_size: int, argv: list[str]):
    """``run_training`` with ``train_step`` wrapped to record whether automatic collection was
    on in each step, and ``gc.collect`` counted."""
    import torch

    torch.set_num_threads(1)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training import run
    from megatron_hybrid.training.train_settings import settings_from_args

    automatic, collected = [], []
    step, real_collect = run.train_step, gc.collect

    def recording_step(*args, **kwargs):
        automatic.append(gc.isenabled())
        return step(*args, **kwargs)

    def collect(generation: int = 2) -> int:
        collected.append(generation)
        return real_collect(generation)

    run.train_step, gc.collect = recording_step, collect
    gc.enable()
    args = settings_from_args(build_parser(load_commands()).parse_args(["train", *argv]))
    run.run_training(args)
    return automatic, collected, gc.isenabled()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("manual", [True, False], ids=["manual-gc", "control-automatic"])
def test_train_collects_between_steps_only(manual):
    argv = ["--hybrid-layer-pattern", "[*E]", "--num-experts", "4", "--train-iters", "3",
            "--eval-interval", "3", "--eval-iters", "1", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--seq-length", "16"]  # fmt: skip
    if manual:
        argv += ["--manual-gc", "--manual-gc-interval", "2"]
    ((automatic, collected, after),) = run_distributed(_train_worker, 1, argv, timeout=300)
    assert after, "the run left Python's automatic collection off"
    if manual:
        # on entering; after iteration 2; before and after the evaluation at iteration 3
        assert automatic == [False] * 3 and collected == [2, 2, 2, 0]
    else:
        assert automatic == [True] * 3 and collected == []

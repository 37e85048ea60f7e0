"""The next step's micro-batches are built while the device runs a step: ``train_step`` calls
``while_queued`` once its device work is queued and before it reads anything on the host, and
``train``'s loop builds each next step's data there, so a step's time counts one build (as
Megatron-LM's iteration time counts its data loading) that the GPU no longer waits for.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.testing.spawn import run_distributed
from megatron_hybrid.training.inputs import StepFeed
from megatron_hybrid.training.phases import HOST, PHASES, PhaseTimer


@pytest.fixture
def tiny(pg):
    from step_setup import tiny_training

    return tiny_training(pg)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "megatron-step"])
def test_while_queued_runs_after_the_last_queued_work(tiny, pg, monkeypatch, fused):
    """The fused step queues the update before its one host read: the data comes between them.
    megatron's guard and optimizer read the device: the data comes before them. Either way it
    runs once, and under a timer it is the step's ``data`` phase."""
    from step_setup import step

    from megatron_hybrid.training import loop

    events = []
    if fused:
        apply, tolist = loop.apply_step, torch.Tensor.tolist
        monkeypatch.setattr(loop, "apply_step",
                            lambda *a: events.append("update") or apply(*a))  # fmt: skip
        # The step's one read on the host: its results copied at the end.
        monkeypatch.setattr(torch.Tensor, "tolist",
                            lambda t: events.append("read") or tolist(t))  # fmt: skip
    else:
        monkeypatch.setenv("MEGATRON_HYBRID_FUSED_STEP", "0")
        update = tiny.optimizer.step
        monkeypatch.setattr(tiny.optimizer, "step",
                            lambda: events.append("update") or update())  # fmt: skip
    timer = PhaseTimer(lambda: None)
    with timer.step():
        result = step(tiny, pg, tiny.batches(0), timer=timer,
                      while_queued=lambda: events.append("data"))  # fmt: skip
    assert result.finite
    if fused:  # nothing read between the update and the data; the results read after it
        after = events[events.index("update") :]
        assert after[:2] == ["update", "data"] and "read" in after[2:], events
    else:
        assert events == ["data", "update"]
    assert list(timer.breakdown()) == [*PHASES, HOST]


def test_the_feed_hands_out_consecutive_steps_and_defers_a_failure():
    """Steps start at samples 10, 14, 18; a step whose next batches were built ahead takes
    those, one that was not builds them on taking; a failure building ahead is raised by the
    next ``take``, not by ``build_next`` (inside the running step)."""
    built = []

    def fetch(first):
        built.append(first)
        if first == 22:
            raise RuntimeError("no sample 22")
        return [first]

    feed = StepFeed(fetch, 10, 4)
    assert feed.take() == [10]
    feed.build_next()
    assert built == [10, 14] and feed.take() == [14]
    assert feed.take() == [18] and built == [10, 14, 18]  # not built ahead: built now
    feed.build_next()  # fails, kept
    with pytest.raises(RuntimeError, match="no sample 22"):
        feed.take()


def _train_worker(rank: int, world_size: int, argv: list[str]):
    """``run_training`` with ``train_step`` and the micro-batch builder recording their order."""
    import torch

    torch.set_num_threads(1)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training import run
    from megatron_hybrid.training.inputs import RunInputs
    from megatron_hybrid.training.train_settings import settings_from_args

    events = []
    step, build = run.train_step, RunInputs.micro_batches

    def recording_step(*args, **kwargs):
        events.append("step")
        result = step(*args, **kwargs)
        events.append("end")
        return result

    def recording_build(self, source, first, count):
        if source is self.train:
            events.append(first)
        return build(self, source, first, count)

    run.train_step, RunInputs.micro_batches = recording_step, recording_build
    args = settings_from_args(build_parser(load_commands()).parse_args(["train", *argv]))
    summary = run.run_training(args)
    return events, summary.losses


@pytest.mark.slow
@pytest.mark.distributed
def test_train_builds_each_next_step_s_data_inside_the_step():
    """Three steps of two samples, an evaluation after the second: the first step's data
    before it, the second's and third's inside the step before each, none inside the last."""
    argv = ["--hybrid-layer-pattern", "[*E]", "--num-experts", "4", "--train-iters", "3",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "16",
            "--eval-interval", "2", "--eval-iters", "1"]  # fmt: skip
    ((events, losses),) = run_distributed(_train_worker, 1, argv, timeout=300)
    assert events == [0, "step", 2, "end", "step", 4, "end", "step", "end"]
    assert len(losses) == 3

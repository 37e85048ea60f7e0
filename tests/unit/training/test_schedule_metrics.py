"""The learning-rate schedule's defaults and wiring into megatron-core's
``OptimizerParamScheduler`` (rates against the closed forms), its resume rules, and the metrics
files (JSONL, TensorBoard, loss curve)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import types

import pytest

from megatron_hybrid.training.schedule import (
    build_scheduler,
    current_lr,
    resolve_schedule,
    restore_scheduler,
)
from megatron_hybrid.training.train_settings import settings_from_args


def _args(**given):
    """``train``'s settings of no flags (its run-dependent defaults unresolved), with ``given``."""
    values = dict(lr=None, train_iters=50, weight_decay=0.01)
    return dataclasses.replace(settings_from_args(argparse.Namespace()), **{**values, **given})


@pytest.mark.parametrize(
    ("fine_tuning", "lora", "expected"),
    [(False, False, (3e-3, 0, "constant")), (True, False, (1e-5, 5, "cosine")),
     (True, True, (1e-4, 5, "cosine"))],
    ids=["from_scratch", "fine_tuning", "lora"],
)  # fmt: skip
def test_defaults_depend_on_the_start(fine_tuning, lora, expected):
    args = resolve_schedule(_args(), fine_tuning=fine_tuning, lora=lora)
    assert (args.lr, args.lr_warmup_iters, args.lr_decay_style) == expected
    assert args.lr_decay_iters == 50 and args.schedule_given == frozenset()
    given = resolve_schedule(_args(lr=0.5, lr_decay_style="linear"), fine_tuning=True, lora=lora)
    assert (given.lr, given.lr_decay_style) == (0.5, "linear")
    assert given.schedule_given == {"--lr", "--lr-decay-style"}


class _Optimizer:
    def __init__(self):
        self.param_groups = [{"lr": None, "weight_decay": None}]


def _rates(args, global_batch, steps):
    optimizer = _Optimizer()
    scheduler = build_scheduler(optimizer, args, global_batch)
    rates = []
    for _ in range(steps):
        rates.append(current_lr(optimizer))
        scheduler.step(increment=global_batch)
    return rates, scheduler


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_rates_follow_megatron_lms_schedule(style):
    """Warm-up from 0, then the decay to --min-lr at --lr-decay-iters, per iteration (the
    scheduler counts samples: iterations x global batch)."""
    args = resolve_schedule(
        _args(lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_style=style, lr_decay_iters=20),
        fine_tuning=False,
        lora=False,
    )
    rates, _ = _rates(args, global_batch=8, steps=25)
    for it, rate in enumerate(rates):
        if it <= 4:
            want = it / 4
        elif style == "constant":
            want = 1.0
        elif it > 20:
            want = 0.1
        else:
            ratio = (it - 4) / 16
            coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
            want = 0.1 + coeff * 0.9
        assert rate == pytest.approx(want, abs=1e-12), (it, rate, want)


def test_resume_keeps_the_checkpoints_schedule_unless_a_flag_is_given():
    saved_args = resolve_schedule(_args(lr=1.0, train_iters=10), fine_tuning=True, lora=False)
    _, saved = _rates(saved_args, global_batch=4, steps=6)
    state = saved.state_dict()
    # Resumed with a longer --train-iters and nothing else: the checkpoint's schedule goes on.
    again = resolve_schedule(_args(train_iters=30), fine_tuning=True, lora=False)
    optimizer = _Optimizer()
    scheduler = build_scheduler(optimizer, again, 4)
    notes = restore_scheduler(scheduler, state, again, 4)
    assert current_lr(optimizer) == pytest.approx(current_lr_of(saved))
    assert notes == [
        "the checkpoint's learning rate decays until iteration 10 and stays at --min-lr after "
        "it; pass --lr-decay-iters 30 to stretch it"
    ]
    # A flag given again replaces the checkpoint's value, and says so.
    given = resolve_schedule(_args(lr=2.0, lr_decay_iters=10, train_iters=10), fine_tuning=True,
                             lora=False)  # fmt: skip
    scheduler = build_scheduler(_Optimizer(), given, 4)
    notes = restore_scheduler(scheduler, state, given, 4)
    assert notes == ["--lr replaces the checkpoint's schedule value (1.0 -> 2.0)"]
    assert scheduler.max_lr == 2.0 and scheduler.num_steps == 24


def current_lr_of(scheduler) -> float:
    return scheduler.get_lr(scheduler.optimizer.param_groups[0])


def test_metrics_files(tmp_path, monkeypatch):
    from megatron_hybrid.training.metrics import MetricsLog, read_metrics

    scalars = []

    class Writer:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, name, value, step):
            scalars.append((name, step))

        def close(self):
            scalars.append(("closed", None))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 3.0}) + "\n" + json.dumps({"step": 2, "loss": 9.0}) + "\n"
    )
    log = MetricsLog(tmp_path, tmp_path / "tb", start=1, enabled=True, title="t")
    log.step(2, loss=2.5, lr=0.1, grad_norm=1.0, tokens_per_second=10.0)
    log.validation(2, 2.0)
    assert log.close() is None
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 3.0},  # kept: the resumed checkpoint's step
        {"step": 2, "loss": 2.5, "lr": 0.1, "grad_norm": 1.0, "tokens_per_second": 10.0},
        {"step": 2, "validation_loss": 2.0},
    ]
    assert ("lm loss", 2) in scalars and ("lm loss validation", 2) in scalars
    assert scalars[-1] == ("closed", None)
    assert (tmp_path / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    # Without matplotlib the curve is not drawn, and a note says so.
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    (tmp_path / "loss_curve.png").unlink()
    note = MetricsLog(tmp_path, None, start=2, enabled=True).close()
    assert note == "loss_curve.png not drawn: needs matplotlib (pip install 'megatron_hybrid[viz]')"
    assert not (tmp_path / "loss_curve.png").exists()

"""Flag rules of the ``train`` command's data, schedule, evaluation, logging and garbage
collection flags
(scope ``train``; :mod:`~megatron_hybrid.training.validation` runs them with the others).

They read the flags after :func:`~megatron_hybrid.training.schedule.resolve_schedule` has filled
in the run-dependent defaults, so a message names the values the run would use.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from megatron_hybrid.training.settings import Rule, Settings, rule

__all__ = ["DATA_RULES"]


def _value(s: Settings, dest: str, default=None):
    return getattr(s.args, dest, default)


def _positive(flag: str, dest: str):
    def problem(s: Settings) -> str | None:
        value = _value(s, dest)
        if value is not None and value < 1:
            return f"{flag} {value} must be >= 1"
        return None

    return rule("train", flag, problem)


def _warmup(s: Settings) -> str | None:
    warmup, decay = _value(s, "lr_warmup_iters"), _value(s, "lr_decay_iters")
    if warmup is None:
        return None
    if warmup < 0:
        return f"--lr-warmup-iters {warmup} must be >= 0"
    if decay is not None and warmup >= decay:
        return (
            f"--lr-warmup-iters {warmup} must be below --lr-decay-iters {decay} (default: "
            "--train-iters): the warm-up ends before the decay does"
        )
    return None


def _min_lr(s: Settings) -> str | None:
    low, high = _value(s, "min_lr"), _value(s, "lr")
    if low is None:
        return None
    if low < 0:
        return f"--min-lr {low} must be >= 0"
    if high is not None and low > high:
        return f"--min-lr {low} is above --lr {high}: the decay would raise the rate"
    return None


def _tensorboard(s: Settings) -> str | None:
    if _value(s, "tensorboard_dir") and importlib.util.find_spec("tensorboard") is None:
        return (
            "--tensorboard-dir needs the tensorboard package, which is not installed: pip "
            "install 'megatron_hybrid[tensorboard]' (or leave the flag out; metrics.jsonl has "
            "the same values)"
        )
    return None


def _log_dir(s: Settings) -> str | None:
    for flag, dest in (("--log-dir", "log_dir"), ("--tensorboard-dir", "tensorboard_dir")):
        folder = _value(s, dest)
        if not folder:
            continue
        path = Path(folder)
        if path.exists() and not path.is_dir():
            return f"{flag} {folder} is a file; it names a folder"
        parent = next((p for p in (path, *path.parents) if p.exists()), Path("."))
        if not os.access(parent, os.W_OK):
            return f"{flag} {folder} cannot be written ({parent} is not writable)"
    return None


def _manual_gc(s: Settings) -> str | None:
    interval = _value(s, "manual_gc_interval", 0)
    if interval < 0:
        return f"--manual-gc-interval {interval} must be >= 0 (0: collect only around evaluations)"
    if _value(s, "manual_gc", False):
        return None
    given = [
        flag
        for flag, on in (
            (f"--manual-gc-interval {interval}", interval),
            ("--no-manual-gc-eval", _value(s, "no_manual_gc_eval", False)),
        )
        if on
    ]
    if given:
        return (
            f"{' and '.join(given)} only apply with --manual-gc (Python's automatic collection "
            "is on without it): add --manual-gc, or leave them out"
        )
    return None


def _seed(s: Settings) -> str | None:
    seed = _value(s, "seed")
    if seed is not None and seed < 0:
        # numpy seeds (megatron-core's GPTDataset shuffles, the synthetic data's streams) are
        # non-negative.
        return f"--seed {seed} must be >= 0"
    return None


def _synthetic_samples(s: Settings) -> str | None:
    if _value(s, "synthetic_samples") == "documents" and _value(s, "data_path"):
        return (
            "--synthetic-samples documents lays out the built-in synthetic data, but --data-path "
            "trains on your data (whose samples megatron-core's GPTDataset cuts): leave one out"
        )
    return None


#: The rules, in the order they are checked.
DATA_RULES: tuple[Rule, ...] = (
    rule("train", "--seed", _seed),
    rule("train", "--synthetic-samples --data-path", _synthetic_samples),
    _positive("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by"),
    _positive("--lr-decay-iters", "lr_decay_iters"),
    rule("train", "--lr-warmup-iters --lr-decay-iters", _warmup),
    rule("train", "--min-lr --lr", _min_lr),
    _positive("--eval-interval", "eval_interval"),
    _positive("--eval-iters", "eval_iters"),
    _positive("--log-interval", "log_interval"),
    rule("train", "--log-dir --tensorboard-dir", _log_dir),
    rule("train", "--tensorboard-dir", _tensorboard),
    rule("train", "--manual-gc --manual-gc-interval --no-manual-gc-eval", _manual_gc),
)

"""The learning-rate schedule: Megatron-LM's flags through megatron-core's
``OptimizerParamScheduler`` (megatron-core 0.19.2, ``megatron/core/optimizer_param_scheduler.py``).

As in Megatron-LM (``megatron/training/training.py``, ``get_optimizer_param_scheduler``) the
scheduler counts samples: warm-up and decay lengths are iterations x global batch, and every
step advances it by the global batch. The rate is linear from 0 to ``--lr`` over
``--lr-warmup-iters``, then ``--lr-decay-style`` down to ``--min-lr`` at ``--lr-decay-iters``.

Defaults depend on what the run starts from (:data:`~megatron_hybrid.training.train_flags.
RUN_DEFAULTS`): a model trained from scratch keeps a constant 3e-3; fine-tuning a released model
(``--load-hf``, ``--load-base``, or resuming such a run) warms up over 10% of the iterations to
1e-5 (1e-4 for LoRA adapters) and decays along a cosine to ``--min-lr``.

A checkpoint keeps the scheduler's state under Megatron-LM's key (``opt_param_scheduler``). A
resume continues it exactly; a schedule flag given again with another value replaces the
checkpoint's (and says so), one not given keeps the checkpoint's.
"""

from __future__ import annotations

import dataclasses

from megatron_hybrid.training.arguments import dest_of
from megatron_hybrid.training.train_flags import RUN_DEFAULTS
from megatron_hybrid.training.train_settings import TrainSettings

__all__ = [
    "SCHEDULER_KEY",
    "build_scheduler",
    "current_lr",
    "resolve_schedule",
    "restore_scheduler",
]

#: The checkpoint's key for the scheduler state (Megatron-LM's).
SCHEDULER_KEY = "opt_param_scheduler"

# Scheduler state field -> the flag that sets it.
_FIELDS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--lr-decay-iters",
    "lr_decay_style": "--lr-decay-style",
}


def resolve_schedule(args: TrainSettings, *, fine_tuning: bool, lora: bool) -> TrainSettings:
    """``args`` with the run-dependent schedule defaults filled in; ``schedule_given`` names the
    schedule flags the command line set (they override a resumed checkpoint's values)."""
    column = 2 if lora else 1 if fine_tuning else 0
    given = {flag for flag in _FIELDS.values() if getattr(args, dest_of(flag)) is not None}
    lr = args.lr if args.lr is not None else RUN_DEFAULTS["--lr"][column]
    warmup = args.lr_warmup_iters
    if warmup is None:
        warmup = args.train_iters // 10 if column else 0
    style = args.lr_decay_style or RUN_DEFAULTS["--lr-decay-style"][column]
    return dataclasses.replace(
        args,
        lr=lr,
        min_lr=args.min_lr if args.min_lr is not None else 0.0,
        lr_warmup_iters=warmup,
        lr_decay_style=style,
        lr_decay_iters=args.lr_decay_iters or args.train_iters,
        schedule_given=frozenset(given),
    )


def build_scheduler(optimizer, args: TrainSettings, global_batch: int):
    """megatron-core's ``OptimizerParamScheduler`` for the resolved flags (the rate of the first
    step is set on the optimizer)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    for group in optimizer.param_groups:  # megatron's groups carry the limits themselves
        if "max_lr" in group:
            group["max_lr"], group["min_lr"] = args.lr, args.min_lr
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * global_batch,
        lr_decay_steps=args.lr_decay_iters * global_batch,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * global_batch,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
    )


def restore_scheduler(scheduler, saved: dict, args: TrainSettings, global_batch: int):
    """Continue a checkpoint's schedule; return notes about what changed.

    Flags given on the command line replace the checkpoint's values; the others are the
    checkpoint's (its decay length too, so a longer ``--train-iters`` does not stretch it).
    """
    ours, merged, notes = scheduler.state_dict(), dict(saved), []
    for field, flag in _FIELDS.items():
        if flag in args.schedule_given and ours[field] != saved.get(field):
            notes.append(
                f"{flag} replaces the checkpoint's schedule value "
                f"({_shown(field, saved.get(field), global_batch)} -> "
                f"{_shown(field, ours[field], global_batch)})"
            )
            merged[field] = ours[field]
    for field in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"):
        merged[field] = ours[field]  # weight decay is constant: this run's --weight-decay
    if "--lr-decay-iters" not in args.schedule_given and merged["lr_decay_style"] != "constant":
        end = merged["lr_decay_steps"] // global_batch
        if end < args.train_iters:
            notes.append(
                f"the checkpoint's learning rate decays until iteration {end} and stays at "
                f"--min-lr after it; pass --lr-decay-iters {args.train_iters} to stretch it"
            )
    scheduler.load_state_dict(merged)
    return notes


def _shown(field: str, value, global_batch: int):
    if field in ("lr_warmup_steps", "lr_decay_steps") and value is not None:
        return f"{value // global_batch} iterations"
    return value


def current_lr(optimizer) -> float:
    """The learning rate the next step uses (the first parameter group's)."""
    value = optimizer.param_groups[0]["lr"]
    return float(value.item() if hasattr(value, "item") else value)

"""``train``: train a hybrid model on your data (``--data-path``) or the built-in synthetic data.

CPU by default (one process); GPUs under ``torchrun --nproc_per_node N -m megatron_hybrid train``.
``--data-path`` reads Megatron data sets (``prepare-data`` writes them) with Megatron-LM's blends
and ``--split``; ``--load-hf`` starts from a Hugging Face model and its tokenizer. Prints loss,
learning rate, gradient norm and tokens/s, the validation loss with ``--eval-interval``, and a
one-line summary; ``--save``/``--load`` write and resume ``torch_dist`` checkpoints, with the
data position and the learning-rate schedule; metrics.jsonl and loss_curve.png go to
``--log-dir`` (or ``--save``).
"""

from __future__ import annotations

import argparse

from megatron_hybrid.cli.main import Command, add_overwrite_flag
from megatron_hybrid.runtime import select_backend
from megatron_hybrid.training.arguments import PATTERN_REQUIRED, add_hybrid_args
from megatron_hybrid.training.train_flags import RUN_DEFAULTS, add_train_flags
from megatron_hybrid.training.train_settings import settings_from_args

__all__ = ["COMMAND", "add_train_only_args", "closing_line"]


def add_train_only_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the ``train`` command that Megatron-LM does not have."""
    group = parser.add_argument_group("megatron_hybrid: train command")
    group.add_argument(
        "--packed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pack sequences into THD micro-batches of a fixed token budget, documents apart "
        "(needs layers that accept packed input; otherwise padded rows are used and the reason "
        "is printed); default: packed with --data-path on GPUs, padded otherwise",
    )
    group.add_argument(
        "--round-up-seq-length",
        action="store_true",
        help="round a fixed --seq-length up to the alignment padding needs (once, at setup)",
    )
    group.add_argument(
        "--verbose",
        action="store_true",
        help="also show the libraries' warnings and log lines (hidden by default)",
    )
    group.add_argument(
        "--on-nonfinite",
        choices=["stop", "skip"],
        default="stop",
        help="a step with a NaN or infinite loss or gradient is never applied: stop the run "
        "(exit 2) or skip the step",
    )
    add_overwrite_flag(
        group,
        "--save DIR",
        "another run's checkpoints or other files, all of them at the first save; iteration "
        "folders this run writes again",
    )


def _configure(parser: argparse.ArgumentParser) -> None:
    # The full list is in --help; a usage line of 60 flags would bury argparse's message.
    parser.usage = "%(prog)s --hybrid-layer-pattern PATTERN [options]"
    add_hybrid_args(parser)
    add_train_only_args(parser)
    add_train_flags(parser)
    # Defaults that depend on the run (training/schedule.py, training/inputs.py fill them in).
    scratch, full, lora = RUN_DEFAULTS["--lr"]
    _redefault(
        parser,
        "lr",
        f"learning rate (default: {scratch}; {full} when fine-tuning "
        f"(--load-hf, --load-base, or a checkpoint of such a run), {lora} for LoRA)",
    )
    _redefault(parser, "vocab_size", "vocabulary size (default: the tokenizer's, padded to a "
               "multiple of --make-vocab-size-divisible-by x TP; the Hugging Face model's with "
               "--load-hf; 256 without a tokenizer)")  # fmt: skip


def _redefault(parser: argparse.ArgumentParser, dest: str, text: str) -> None:
    """Make a shared flag's default None (resolved by the run) with its help saying so."""
    parser.set_defaults(**{dest: None})
    for action in parser._actions:  # argparse keeps no public registry
        if action.dest == dest:
            action.help = text


def _run(args: argparse.Namespace) -> int:
    import torch

    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.training.run import run_training

    if not (args.hybrid_layer_pattern or args.load_hf or args.load or args.load_base):
        raise ValueError(f"{PATTERN_REQUIRED} (or --load-hf HF_DIR, whose config sets the model)")
    started_world = not torch.distributed.is_initialized()
    try:
        summary = run_training(settings_from_args(args), backend=select_backend())
    except BaseException:
        # A check that refuses the run after this command started the world: a process group
        # left to the interpreter's exit can abort it ("terminate called without an active
        # exception") instead of exiting with the error's code. A caller's world stays.
        if started_world and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        raise
    rank = torch.distributed.get_rank()
    torch.distributed.destroy_process_group()
    if rank == 0:
        print(closing_line(summary), flush=True)
    return 0


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def closing_line(summary) -> str:
    """``done: ...``: steps, loss, median step time and tokens/s after warm-up (on GPUs also
    TFLOP/s per GPU and MFU), the warm-up apart (its kernel autotuning would otherwise swamp
    the throughput), the last save."""
    losses = summary.losses
    first, last = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
    parts = [
        f"done: {len(losses)} steps ({summary.first_iteration}->{summary.last_iteration})",
        f"loss {first:.4f} -> {last:.4f}",
    ]
    if summary.validation_losses:
        parts.append(f"validation loss {summary.validation_losses[-1][1]:.4f}")
    median = summary.median_step_seconds
    if median is not None:
        parts.append(f"median step {_duration(median)}, {summary.tokens_per_second:,.0f} tok/s")
    if summary.throughput:  # GPUs: TFLOP/s per GPU and MFU, from the model's FLOP formulas
        parts.append(summary.throughput)
    if summary.step_seconds:
        after = "" if median is not None else ", no later step to time"
        parts.append(f"warm-up {_duration(summary.warmup_seconds)}{after}")
    if summary.saved:
        parts.append(f"saved {summary.saved}")
    return " | ".join(parts)


COMMAND = Command(
    name="train",
    help="train a hybrid model on your data or synthetic data (CPU by default, GPUs under "
    "torchrun)",
    configure=_configure,
    run=_run,
    description=__doc__,
)

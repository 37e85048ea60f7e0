"""The ``train`` command's flags for data, the learning-rate schedule, evaluation, logging,
garbage collection and benchmarking.

Megatron-LM's names and meaning (``megatron/training/arguments.py``); Megatron-LM's own parser
has every one of them except ``--log-dir`` and ``--synthetic-samples`` (the package's built-in
data), so they are not offered to its scripts.
Several defaults depend on the run: :func:`megatron_hybrid.training.schedule.resolve_schedule`
and :func:`megatron_hybrid.training.inputs.resolve_data` fill them in, and :data:`RUN_DEFAULTS`
states them for ``--help`` and the docs.
"""

from __future__ import annotations

import argparse

from megatron_hybrid.training.arguments import Flag

__all__ = ["FINE_TUNING", "RUN_DEFAULTS", "TRAIN_FLAGS", "add_train_flags"]

_DATA, _LR, _LOG = "data", "learning-rate schedule", "evaluation and logging"
_GC = "garbage collection"
_BENCH = "benchmarking"

#: What a run that starts from trained weights is (its defaults differ).
FINE_TUNING = "fine-tuning (--load-hf, --load-base, or a checkpoint of such a run)"

#: The run-dependent defaults: flag -> (from scratch, fine-tuning, LoRA fine-tuning).
RUN_DEFAULTS = {
    "--lr": (3e-3, 1e-5, 1e-4),
    "--lr-warmup-iters": ("0", "10% of --train-iters", "10% of --train-iters"),
    "--lr-decay-style": ("constant", "cosine", "cosine"),
}


def _run_default(flag: str) -> str:
    scratch, full, lora = RUN_DEFAULTS[flag]
    text = f"(default: {scratch}; {full} when fine-tuning, {lora} for LoRA)"
    return text.replace("%", "%%")  # argparse formats help strings


TRAIN_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--data-path",
        _DATA,
        dict(
            nargs="+",
            default=None,
            metavar="[W] PREFIX",
            help="train on Megatron data sets: PREFIX (PREFIX.bin/.idx, from prepare-data or "
            "Megatron-LM's preprocess_data.py) or a blend W1 PREFIX1 W2 PREFIX2 ... (default: "
            "the built-in synthetic data)",
        ),
    ),
    Flag(
        "--synthetic-samples",
        _DATA,
        dict(
            choices=["sequence", "documents"],
            default="sequence",
            help="without --data-path: each sample one synthetic sequence of log-normal length "
            "(sequence, the default), or --seq-length tokens of whole sequences back to back, "
            "each a document of its own, as megatron-core's GPTDataset cuts samples from a corpus "
            "(documents: full rows, several documents per packed micro-batch)",
        ),
    ),
    Flag(
        "--split",
        _DATA,
        dict(
            default=None,
            help="train, validation and test proportions of --data-path, e.g. 98,2,0 "
            "(default: 969,30,1, Megatron-LM's)",
        ),
    ),
    Flag(
        "--tokenizer-model",
        _DATA,
        dict(
            default=None,
            metavar="HF_DIR",
            help="the Hugging Face tokenizer the data was prepared with; it sets the "
            "vocabulary when --vocab-size is not given (default: the --load-hf folder's)",
        ),
    ),
    Flag(
        "--data-cache-path",
        _DATA,
        dict(
            default=None,
            metavar="DIR",
            help="where megatron-core keeps the data's index cache (default: beside the data)",
        ),
    ),
    Flag(
        "--make-vocab-size-divisible-by",
        _DATA,
        dict(
            type=int,
            default=128,
            help="pad a tokenizer's vocabulary to a multiple of this x TP for the model",
        ),
    ),
    Flag(
        "--min-lr",
        _LR,
        dict(type=float, default=None, help="the learning rate the decay ends at (default: 0)"),
    ),
    Flag(
        "--lr-warmup-iters",
        _LR,
        dict(
            type=int,
            default=None,
            help="iterations of linear warm-up from 0 to --lr " + _run_default("--lr-warmup-iters"),
        ),
    ),
    Flag(
        "--lr-decay-style",
        _LR,
        dict(
            choices=["constant", "linear", "cosine"],
            default=None,
            help="decay from --lr to --min-lr after the warm-up "
            + _run_default("--lr-decay-style"),
        ),
    ),
    Flag(
        "--lr-decay-iters",
        _LR,
        dict(
            type=int,
            default=None,
            help="iterations the decay ends at (default: --train-iters)",
        ),
    ),
    Flag(
        "--eval-interval",
        _LOG,
        dict(
            type=int,
            default=None,
            help="every N iterations and at the end, print and log the validation loss "
            "(default: no evaluation)",
        ),
    ),
    Flag(
        "--eval-iters",
        _LOG,
        dict(
            type=int,
            default=100,
            help="global batches of the validation split per evaluation (the same ones each "
            "time)",
        ),
    ),
    Flag(
        "--log-interval",
        _LOG,
        dict(type=int, default=1, help="print a progress line every N iterations"),
    ),
    Flag(
        "--log-dir",
        _LOG,
        dict(
            default=None,
            metavar="DIR",
            help="where metrics.jsonl and loss_curve.png go (default: the --save folder; "
            "neither without --save)",
        ),
    ),
    Flag(
        "--tensorboard-dir",
        _LOG,
        dict(
            default=None,
            metavar="DIR",
            help="also write TensorBoard logs there (needs the tensorboard extra)",
        ),
    ),
    Flag(
        "--manual-gc",
        _GC,
        dict(
            action="store_true",
            help="turn Python's automatic garbage collection off for the run and collect only "
            "between steps (--manual-gc-interval) and around evaluations: no collection "
            "inside a step (Megatron-LM's flag)",
        ),
    ),
    Flag(
        "--manual-gc-interval",
        _GC,
        dict(
            type=int,
            default=0,
            help="with --manual-gc, collect after every N iterations (default: 0, only around "
            "evaluations)",
        ),
    ),
    Flag(
        "--no-manual-gc-eval",
        _GC,
        dict(
            action="store_true",
            help="with --manual-gc, do not collect before and after each evaluation",
        ),
    ),
    Flag(
        "--moe-router-force-load-balancing",
        _BENCH,
        dict(
            action="store_true",
            help="route by random logits, so every expert gets about as many tokens as any "
            "other, as a trained router's would (for benchmarks only: routing is not learnt; "
            "megatron-core's moe_router_force_load_balancing)",
        ),
    ),
)


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """Add :data:`TRAIN_FLAGS`, grouped, to the ``train`` parser."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in TRAIN_FLAGS:
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(f"megatron_hybrid: {flag.group}")
        groups[flag.group].add_argument(flag.option, **flag.kwargs)

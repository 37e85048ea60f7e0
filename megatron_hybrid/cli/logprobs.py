"""``logprobs``: per-token log-probs of token sequences under a converted or trained model.

Reads a JSONL file with one ``{"input_ids": [...]}`` per line and writes one
``{"logprobs": [...]}`` per line (with ``--entropy`` also ``"entropies"``): entry ``j`` is
``log p(input_ids[j + 1] | input_ids[: j + 1])``, so a converted model can be checked against an
inference engine's prompt log-probs. The model comes from ``--load-hf HF_DIR`` (with
``--load-peft ADAPTER``: the base with that PEFT adapter, as peft computes it) or ``--load CKPT``:
a converted checkpoint, a ``train`` checkpoint (its recorded settings give the model; model
flags are needed only for checkpoints that record none) or a LoRA run (its recorded base with
its adapters). The vocabulary's padding rows, where a checkpoint records its real vocabulary,
are left out. Sequences are packed into THD micro-batches whenever the model's layers pack. CPU
by default; GPUs under ``torchrun --nproc_per_node N -m megatron_hybrid logprobs``.
"""

from __future__ import annotations

import argparse

from megatron_hybrid.cli.main import Command, add_overwrite_flag
from megatron_hybrid.logprobs import DEFAULT_MAX_TOKENS
from megatron_hybrid.runtime import select_backend
from megatron_hybrid.training.arguments import (
    LOGPROBS_FLAGS,
    MODEL_SHAPE_GROUPS,
    add_hybrid_args,
)
from megatron_hybrid.training.train_settings import settings_from_args

__all__ = ["COMMAND"]

#: What the shared flags mean here (their help is written for train).
_HELP = {
    "load": "checkpoint to score: converted (convert --from-hf), trained (train --save; its "
    "recorded settings give the model) or a LoRA run (its recorded base with its adapters)",
    "load_hf": "Hugging Face folder to score: its config sets the model, its weights the values",
    "load_peft": "with --load-hf BASE: PEFT adapter folder to apply to the base (read as peft "
    "reads it, docs/lora.md)",
    "hybrid_layer_pattern": "layer pattern of a --load checkpoint that records none (a train "
    "checkpoint records it)",
}


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.usage = (
        "%(prog)s --input FILE.jsonl (--load-hf HF_DIR [--load-peft ADAPTER] | --load CKPT) "
        "[options]"
    )
    group = parser.add_argument_group("megatron_hybrid: logprobs command")
    group.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help='JSONL file, one {"input_ids": [...]} per line',
    )
    group.add_argument(
        "--output",
        metavar="FILE",
        help="write the JSONL results here (default: standard output); checked before any "
        "scoring, written whole or not at all",
    )
    add_overwrite_flag(group, "--output FILE")
    group.add_argument("--entropy", action="store_true", help="also write per-token entropies")
    group.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature of the log-probs"
    )
    group.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="tokens per forward pass, alignment padding included",
    )
    group.add_argument(
        "--verbose",
        action="store_true",
        help="also show the libraries' warnings and log lines (hidden by default)",
    )
    add_hybrid_args(parser, groups=MODEL_SHAPE_GROUPS, options=LOGPROBS_FLAGS)
    for action in parser._actions:  # argparse keeps no public registry
        text = _HELP.get(action.dest)
        if text is not None:
            action.help = text


def _run(args: argparse.Namespace) -> int:
    import torch

    # lazy: loads torch and megatron, and --help imports every command module
    from megatron_hybrid.training.logprobs_job import LogprobsJob, run_logprobs

    job = LogprobsJob(
        input=args.input,
        output=args.output,
        entropy=args.entropy,
        temperature=args.temperature,
        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
        overwrite=args.overwrite,
    )
    started_world = not torch.distributed.is_initialized()
    try:
        run_logprobs(settings_from_args(args), job, backend=select_backend())
    finally:
        # Also on a refusal: a process group left to the interpreter's exit can abort it.
        if started_world and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


COMMAND = Command(
    name="logprobs",
    help="per-token log-probs of JSONL token sequences under a --load-hf or --load model",
    configure=_configure,
    run=_run,
    description=__doc__,
)

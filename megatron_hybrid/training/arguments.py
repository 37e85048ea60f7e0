"""Command-line flags (Megatron-LM's names), their defaults and the pattern they carry.

:func:`add_hybrid_args` adds the flags to any ``argparse`` parser. It skips flags the parser
already has, so it also works as Megatron-LM's ``extra_args_provider`` (Megatron-LM defines most
of them itself). :func:`megatron_hybrid.training.config.hybrid_config_from_args` turns parsed
flags into a ``TransformerConfig``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from megatron_hybrid.pattern import (
    ParsedPattern,
    parse_pattern,
)

__all__ = [
    "FLAGS",
    "FLAG_GROUPS",
    "FORWARD_LAYOUT_FLAGS",
    "GIVEN",
    "LOGPROBS_FLAGS",
    "MEGATRON_LM_GROUPS",
    "MODEL_SHAPE_GROUPS",
    "PATTERN_REQUIRED",
    "RUNTIME_CHOICES",
    "Flag",
    "add_hybrid_args",
    "dest_of",
    "given_flags",
    "model_setting_dests",
    "required_pattern",
    "spec_backend",
]


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its option string and ``add_argument`` keywords."""

    option: str
    group: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        """argparse's ``dest``: the one given, else :func:`dest_of` the option."""
        return self.kwargs.get("dest") or dest_of(self.option)


def _flag(option: str, group: str, **kwargs: Any) -> Flag:
    return Flag(option, group, kwargs)


_MODEL, _PARALLEL, _MOE, _TRAIN, _CKPT = "model", "parallelism", "MoE", "training", "checkpointing"
_LORA = "LoRA"

#: Every flag the package defines, in ``--help`` order (frozen by a snapshot test).
#: The one message for a missing pattern (train, check-checkpoint, Megatron-LM integration).
PATTERN_REQUIRED = "--hybrid-layer-pattern is required, e.g. --hybrid-layer-pattern '[*E]{4}'"

FLAGS: tuple[Flag, ...] = (
    _flag(
        "--hybrid-layer-pattern",
        _MODEL,
        type=str,
        default=None,
        help="layer pattern, e.g. '[*E]{4}' or '[*-]{2}|[*E]{2}/*E' (docs/pattern_grammar.md)",
    ),
    _flag("--hidden-size", _MODEL, type=int, default=64, help="hidden size"),
    _flag("--num-attention-heads", _MODEL, type=int, default=4, help="attention heads"),
    _flag(
        "--num-query-groups",
        _MODEL,
        type=int,
        default=None,
        help="query groups for grouped-query attention (default: one per head)",
    ),
    _flag(
        "--kv-channels",
        _MODEL,
        type=int,
        default=None,
        help="channels per attention head (default: hidden size / heads)",
    ),
    _flag(
        "--ffn-hidden-size",
        _MODEL,
        type=int,
        default=None,
        help="dense MLP hidden size (default: 4 x hidden size)",
    ),
    _flag(
        "--normalization",
        _MODEL,
        choices=["LayerNorm", "RMSNorm"],
        default="LayerNorm",
        help="normalization layer",
    ),
    _flag("--swiglu", _MODEL, action="store_true", help="SwiGLU MLPs (needed by 'G' layers)"),
    _flag(
        "--disable-bias-linear",
        _MODEL,
        action="store_true",
        help="no biases in linear layers (always on for MoE layers here)",
    ),
    _flag("--qk-layernorm", _MODEL, action="store_true", help="layer norm on queries and keys"),
    _flag(
        "--position-embedding-type",
        _MODEL,
        choices=["rope", "learned_absolute", "none"],
        default="rope",
        help="position embedding",
    ),
    _flag(
        "--untie-embeddings-and-output-weights",
        _MODEL,
        action="store_true",
        help="separate output layer weights",
    ),
    _flag("--mamba-state-dim", _MODEL, type=int, default=16, help="Mamba ('M') SSM state size"),
    _flag("--mamba-head-dim", _MODEL, type=int, default=16, help="Mamba ('M') head dimension"),
    _flag(
        "--mamba-num-groups",
        _MODEL,
        type=int,
        default=2,
        help="Mamba ('M') B/C groups (heads and groups must divide over TP)",
    ),
    _flag(
        "--mamba-num-heads",
        _MODEL,
        type=int,
        default=None,
        help="Mamba ('M') heads (default: 2 x hidden size / --mamba-head-dim)",
    ),
    _flag(
        "--mamba-impl",
        _MODEL,
        choices=["auto", "torch", "kernels"],
        default="auto",
        help="Mamba ('M') compute: mamba_ssm kernels, the torch Mamba2 path, or auto (kernels "
        "where mamba_ssm and causal_conv1d run on a GPU, else torch)",
    ),
    _flag("--vocab-size", _MODEL, type=int, default=256, help="vocabulary size"),
    _flag(
        "--max-position-embeddings",
        _MODEL,
        type=int,
        default=None,
        help="maximum sequence length (default: --seq-length)",
    ),
    _flag(
        "--q-lora-rank",
        _MODEL,
        type=int,
        default=None,
        help="MLA ('+'): rank of the query down-projection (default: queries not compressed)",
    ),
    _flag(
        "--kv-lora-rank",
        _MODEL,
        type=int,
        default=32,
        help="MLA ('+'): rank of the key-value down-projection",
    ),
    _flag("--qk-head-dim", _MODEL, type=int, default=16, help="MLA ('+'): query/key head dim"),
    _flag(
        "--qk-pos-emb-head-dim",
        _MODEL,
        type=int,
        default=8,
        help="MLA ('+'): query/key channels that carry RoPE (even)",
    ),
    _flag("--v-head-dim", _MODEL, type=int, default=16, help="MLA ('+'): value head dim"),
    _flag(
        "--transformer-impl",
        _MODEL,
        choices=["local", "transformer_engine"],
        default="local",
        help="module implementation: Megatron-Core modules or TransformerEngine",
    ),
    _flag("--tensor-model-parallel-size", _PARALLEL, type=int, default=1, help="TP size"),
    _flag(
        "--pipeline-model-parallel-size",
        _PARALLEL,
        type=int,
        default=1,
        help="PP size; with '|' in the pattern, VPP = segments / PP",
    ),
    _flag("--expert-model-parallel-size", _PARALLEL, type=int, default=1, help="EP size"),
    _flag(
        "--expert-tensor-parallel-size",
        _PARALLEL,
        type=int,
        default=None,
        help="expert TP size (default: TP size)",
    ),
    _flag("--context-parallel-size", _PARALLEL, type=int, default=1, help="CP size"),
    _flag("--sequence-parallel", _PARALLEL, action="store_true", help="sequence parallelism"),
    _flag(
        "--overlap-moe-expert-parallel-comm",
        _PARALLEL,
        action="store_true",
        help="overlap EP all-to-all with compute (combined-1F1B schedule; needs EP>1, bf16)",
    ),
    _flag(
        "--delay-wgrad-compute",
        _PARALLEL,
        action="store_true",
        help="delay weight-gradient computation (with EP overlap)",
    ),
    _flag(
        "--hybrid-cuda-graphs",
        _PARALLEL,
        action="store_true",
        help="replay each layer's compute pieces (token mixers, dense MLP, router, shared "
        "experts) as CUDA graphs, in the plain and the EP-overlap schedule (GPUs; "
        "docs/ep_overlap.md)",
    ),
    _flag("--num-experts", _MOE, type=int, default=None, help="experts per MoE layer"),
    _flag("--moe-router-topk", _MOE, type=int, default=2, help="experts per token"),
    _flag(
        "--moe-router-pre-softmax",
        _MOE,
        action="store_true",
        help="softmax over all experts before the top-k (needed with --moe-router-topk 1)",
    ),
    _flag(
        "--moe-ffn-hidden-size",
        _MOE,
        type=int,
        default=None,
        help="expert hidden size (default: --ffn-hidden-size)",
    ),
    _flag(
        "--moe-shared-expert-intermediate-size",
        _MOE,
        type=int,
        default=None,
        help="shared-expert hidden size (no shared expert by default)",
    ),
    _flag("--moe-grouped-gemm", _MOE, action="store_true", help="grouped-GEMM experts"),
    _flag(
        "--moe-token-dispatcher-type",
        _MOE,
        choices=["alltoall", "allgather", "flex"],
        default="alltoall",
        help="token dispatcher",
    ),
    _flag(
        "--moe-flex-dispatcher-backend",
        _MOE,
        choices=["deepep", "hybridep"],
        default="deepep",
        help="backend of the flex dispatcher",
    ),
    _flag("--moe-aux-loss-coeff", _MOE, type=float, default=0.0, help="load-balancing loss"),
    _flag("--seq-length", _TRAIN, type=int, default=128, help="maximum sequence length"),
    _flag("--micro-batch-size", _TRAIN, type=int, default=4, help="sequences per micro-batch"),
    _flag(
        "--global-batch-size",
        _TRAIN,
        type=int,
        default=None,
        help="sequences per step (default: micro-batch size x data-parallel size)",
    ),
    _flag("--train-iters", _TRAIN, type=int, default=30, help="training steps"),
    _flag("--lr", _TRAIN, type=float, default=3e-3, help="learning rate"),
    _flag("--weight-decay", _TRAIN, type=float, default=0.01, help="AdamW weight decay"),
    _flag("--clip-grad", _TRAIN, type=float, default=1.0, help="gradient-norm clipping"),
    _flag("--bf16", _TRAIN, action="store_true", help="bf16 parameters and compute"),
    _flag("--seed", _TRAIN, type=int, default=1234, help="random seed"),
    _flag(
        "--recompute-granularity",
        _TRAIN,
        choices=["full", "selective"],
        default=None,
        help="activation recompute",
    ),
    _flag(
        "--recompute-method",
        _TRAIN,
        choices=["uniform", "block"],
        default=None,
        help="full recompute over logical layers: uniform or block",
    ),
    _flag(
        "--recompute-num-layers",
        _TRAIN,
        type=int,
        default=None,
        help="logical layers per recompute chunk (uniform) or recomputed (block)",
    ),
    _flag(
        "--no-gradient-accumulation-fusion",
        _TRAIN,
        action="store_false",
        dest="gradient_accumulation_fusion",
        help="on GPUs, let DDP add each local linear's weight gradient into main_grad rather "
        "than the weight-gradient GEMM (docs/performance.md)",
    ),
    _flag("--save", _CKPT, type=str, default=None, help="directory to save checkpoints to"),
    _flag("--load", _CKPT, type=str, default=None, help="directory to resume from"),
    _flag(
        "--load-hf",
        _CKPT,
        type=str,
        default=None,
        help="Hugging Face folder to start from: its config sets the model (pattern, sizes), "
        "its weights the initial values (docs/hf_checkpoints.md)",
    ),
    _flag(
        "--save-interval", _CKPT, type=int, default=None, help="save every N steps (and at the end)"
    ),
    _flag(
        "--load-base",
        _LORA,
        type=str,
        default=None,
        help="torch_dist checkpoint whose model weights are the frozen base of a LoRA run",
    ),
    _flag(
        "--load-peft",
        _LORA,
        type=str,
        default=None,
        help="PEFT adapter folder to start the LoRA adapters from (its config sets rank, alpha "
        "and targets)",
    ),
    _flag(
        "--lora-rank",
        _LORA,
        type=int,
        default=None,
        help="train LoRA adapters of this rank on a frozen base (--load-hf or --load-base); "
        "checkpoints then hold the adapters only (docs/lora.md)",
    ),
    _flag(
        "--lora-alpha",
        _LORA,
        type=float,
        default=None,
        help="LoRA scale numerator: the update is alpha/rank * B A (default: the rank)",
    ),
    _flag(
        "--lora-targets",
        _LORA,
        nargs="+",
        default=None,
        metavar="NAME",
        help="what to adapt: all-linear (default), Megatron names (linear_qkv, linear_fc1, "
        "...), Hugging Face names (q_proj, ...), experts.gate_up_proj, or module paths with "
        "wildcards",
    ),
    _flag(
        "--lora-exclude",
        _LORA,
        nargs="+",
        default=None,
        metavar="NAME",
        help="names in the forms of --lora-targets that get no adapter",
    ),
    _flag(
        "--lora-dropout",
        _LORA,
        type=float,
        default=None,
        help="dropout on the adapters' input while training (default: 0, or what the "
        "--load-peft folder or the resumed run says)",
    ),
)


#: Flag groups; ``check-checkpoint`` uses only the model-shape ones.
FLAG_GROUPS = (_MODEL, _PARALLEL, _MOE, _TRAIN, _CKPT, _LORA)
#: The parallel layout a forward pass runs on (``logprobs``; ``train`` has the whole
#: parallelism group: EP overlap, delayed weight gradients and CUDA graphs concern training, and
#: ``forward_logprobs`` refuses context parallelism).
FORWARD_LAYOUT_FLAGS = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    "--sequence-parallel",
)
#: What ``logprobs`` reads besides the model-shape groups: the layout, the dtype and where the
#: model (and its adapter) come from.
LOGPROBS_FLAGS = (*FORWARD_LAYOUT_FLAGS, "--bf16", "--load", "--load-hf", "--load-peft")
#: The groups Megatron-LM's scripts get (``training/megatron_lm.py``): LoRA runs only through
#: ``train``, so its flags are not offered where they would do nothing.
MEGATRON_LM_GROUPS = (_MODEL, _PARALLEL, _MOE, _TRAIN, _CKPT)
MODEL_SHAPE_GROUPS = (_MODEL, _MOE)

#: Flags of the model-shape groups that choose how to run, not what the model is: a checkpoint
#: does not record them and ``check-checkpoint`` does not compare them.
RUNTIME_CHOICES = frozenset(
    {
        "--mamba-impl",
        "--moe-token-dispatcher-type",
        "--moe-flex-dispatcher-backend",
        "--moe-aux-loss-coeff",
    }
)


def dest_of(option: str) -> str:
    """argparse's ``dest`` of an option (``--hidden-size`` -> ``hidden_size``)."""
    return option.lstrip("-").replace("-", "_")


def model_setting_dests() -> tuple[str, ...]:
    """The ``dest`` of every model setting, in ``--help`` order: the model-shape flags without
    :data:`RUNTIME_CHOICES` (what a ``train`` checkpoint records)."""
    return tuple(
        flag.dest
        for flag in FLAGS
        if flag.group in MODEL_SHAPE_GROUPS and flag.option not in RUNTIME_CHOICES
    )


#: Attribute of a parsed namespace: the ``dest`` of every package flag given on the command line
#: (:func:`given_flags`), so that a flag a source overrides is refused, not ignored.
GIVEN = "_given_flags"


def _record_given(namespace: argparse.Namespace, dest: str) -> None:
    setattr(namespace, GIVEN, frozenset({*getattr(namespace, GIVEN, ()), dest}))


class _GivenStore(argparse._StoreAction):  # argparse keeps no public action classes
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _record_given(namespace, self.dest)


class _GivenStoreTrue(argparse._StoreTrueAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _record_given(namespace, self.dest)


class _GivenStoreFalse(argparse._StoreFalseAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _record_given(namespace, self.dest)


_RECORDING = {None: _GivenStore, "store_true": _GivenStoreTrue, "store_false": _GivenStoreFalse}


def given_flags(args: argparse.Namespace) -> frozenset[str]:
    """The ``dest`` of the package flags given on the command line (not their defaults).

    Read once, where the command line is parsed: ``TrainSettings.given`` carries them on
    (``training/train_settings.py``).
    """
    return getattr(args, GIVEN, frozenset())


def add_hybrid_args(
    parser: argparse.ArgumentParser,
    groups: tuple[str, ...] = FLAG_GROUPS,
    options: tuple[str, ...] = (),
) -> argparse.ArgumentParser:
    """Add the package's flags to ``parser``; flags it already defines are left alone.

    Usable as Megatron-LM's ``extra_args_provider``. The flags record that they were given
    (:func:`given_flags`).

    Args:
        parser: the parser to extend.
        groups: which flag groups to add (default: all).
        options: further flags to add, by option string, from groups not in ``groups``.
    """
    unknown = set(options) - {flag.option for flag in FLAGS}
    if unknown:
        raise ValueError(f"add_hybrid_args: no such flags {sorted(unknown)}")
    existing = set(parser._option_string_actions)  # argparse keeps no public registry
    added: dict[str, argparse._ArgumentGroup] = {}
    for flag in FLAGS:
        if flag.option in existing or (flag.group not in groups and flag.option not in options):
            continue
        if flag.group not in added:
            added[flag.group] = parser.add_argument_group(f"megatron_hybrid: {flag.group}")
        kwargs = {**flag.kwargs, "action": _RECORDING[flag.kwargs.get("action")]}
        added[flag.group].add_argument(flag.option, **kwargs)
    return parser


def required_pattern(args: Any) -> ParsedPattern:
    """The parsed ``--hybrid-layer-pattern``; a ValueError saying so when it is missing.

    Args:
        args: the flags: ``TrainSettings`` (``training/train_settings.py``), or Megatron-LM's
            own namespace (``training/megatron_lm.py``: its API).
    """
    if not args.hybrid_layer_pattern:
        raise ValueError(PATTERN_REQUIRED)
    return parse_pattern(args.hybrid_layer_pattern)


def spec_backend(args) -> str:
    """``hybrid_stack_spec``'s backend for ``--transformer-impl`` (``"te"`` or ``"local"``)."""
    return "te" if args.transformer_impl == "transformer_engine" else "local"

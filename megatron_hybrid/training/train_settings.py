"""The flags of ``train`` as one typed, frozen object, made once at the command line's edge.

The command line parses ``argparse`` flags; :func:`settings_from_args` turns the parsed namespace
into :class:`TrainSettings` once, and ``train`` (:func:`~megatron_hybrid.training.run.
run_training`), ``logprobs``, ``check-checkpoint`` and the rule table
(:mod:`~megatron_hybrid.training.validation`) read that. Steps that complete the flags (a Hugging
Face model's architecture, the tokenizer's vocabulary, the schedule's run-dependent defaults, a
checkpoint's recorded model) return a new object through :func:`dataclasses.replace`.

The flags are defined in one place, the parser (``arguments.FLAGS``, ``train_flags.TRAIN_FLAGS``
and the ``train`` command's own, ``cli/train.py``); the fields here carry their ``dest`` names and
the types their ``type=`` and ``action`` give, and a unit test holds the two equal
(``tests/unit/training/test_train_settings.py``). Defaults come from the flag definitions, so a
namespace of a parser that defines only some of the flags (``check-checkpoint``, ``logprobs``)
is completed with ``train``'s defaults.

Megatron-LM's own scripts (:mod:`~megatron_hybrid.training.megatron_lm`) keep Megatron-LM's
argparse namespace: that is its API, and it holds hundreds of flags this package never reads.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_hybrid.training.arguments import FLAGS, Flag, given_flags
from megatron_hybrid.training.train_flags import TRAIN_FLAGS

__all__ = [
    "COMMAND_DEFAULTS",
    "NOT_FLAGS",
    "TrainSettings",
    "flag_defaults",
    "require_settings",
    "settings_from_args",
]

#: Defaults of the ``train`` command's own flags (``cli/train.py``, ``add_train_only_args``),
#: for namespaces of other commands' parsers; a unit test holds them equal to the parser's.
COMMAND_DEFAULTS: dict[str, Any] = {
    "packed": None,
    "round_up_seq_length": False,
    "verbose": False,
    "on_nonfinite": "stop",
    "overwrite": False,
}

#: Fields that are not flags: what the run knows about how the flags were given.
NOT_FLAGS = ("given", "schedule_given")


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """Every flag of ``train`` (its ``dest``, typed as the parser reads it) and which were given.

    Model flags are ``None`` where a command reads them from a checkpoint until they are
    completed (``check-checkpoint``, ``logprobs --load``: :mod:`~megatron_hybrid.training.
    recorded`); ``lr``, ``vocab_size`` and the schedule flags ``None`` until the run resolves
    them (:func:`~megatron_hybrid.training.schedule.resolve_schedule`,
    :func:`~megatron_hybrid.training.inputs.resolve_data`).

    Attributes:
        given: ``dest`` of the package flags given on the command line (not their defaults):
            a flag that a source of the model overrides is refused, not ignored.
        schedule_given: the schedule flags (as options) the command line set; filled in by
            ``resolve_schedule``, they replace a resumed checkpoint's values.
    """

    # model (``arguments.FLAGS``)
    hybrid_layer_pattern: str | None
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None
    kv_channels: int | None
    ffn_hidden_size: int | None
    normalization: str
    swiglu: bool
    disable_bias_linear: bool
    qk_layernorm: bool
    position_embedding_type: str
    untie_embeddings_and_output_weights: bool
    mamba_state_dim: int
    mamba_head_dim: int
    mamba_num_groups: int
    mamba_num_heads: int | None
    mamba_impl: str
    vocab_size: int | None
    max_position_embeddings: int | None
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    transformer_impl: str

    # parallelism
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int | None
    context_parallel_size: int
    sequence_parallel: bool
    overlap_moe_expert_parallel_comm: bool
    delay_wgrad_compute: bool
    hybrid_cuda_graphs: bool

    # MoE
    num_experts: int | None
    moe_router_topk: int
    moe_router_pre_softmax: bool
    moe_ffn_hidden_size: int | None
    moe_shared_expert_intermediate_size: int | None
    moe_grouped_gemm: bool
    moe_token_dispatcher_type: str
    moe_flex_dispatcher_backend: str
    moe_aux_loss_coeff: float

    # training
    seq_length: int
    micro_batch_size: int
    global_batch_size: int | None
    train_iters: int
    lr: float | None
    weight_decay: float
    clip_grad: float
    bf16: bool
    seed: int
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    gradient_accumulation_fusion: bool

    # checkpointing
    save: str | None
    load: str | None
    load_hf: str | None
    save_interval: int | None

    # LoRA
    load_base: str | None
    load_peft: str | None
    lora_rank: int | None
    lora_alpha: float | None
    lora_targets: list[str] | None
    lora_exclude: list[str] | None
    lora_dropout: float | None

    # the ``train`` command's own (``cli/train.py``)
    packed: bool | None
    round_up_seq_length: bool
    verbose: bool
    on_nonfinite: str
    overwrite: bool

    # data (``train_flags.TRAIN_FLAGS``)
    data_path: list[str] | None
    synthetic_samples: str
    split: str | None
    tokenizer_model: str | None
    data_cache_path: str | None
    make_vocab_size_divisible_by: int

    # learning-rate schedule
    min_lr: float | None
    lr_warmup_iters: int | None
    lr_decay_style: str | None
    lr_decay_iters: int | None

    # evaluation and logging
    eval_interval: int | None
    eval_iters: int
    log_interval: int
    log_dir: str | None
    tensorboard_dir: str | None

    # garbage collection
    manual_gc: bool
    manual_gc_interval: int
    no_manual_gc_eval: bool

    # benchmarking
    moe_router_force_load_balancing: bool
    given: frozenset[str] = frozenset()
    schedule_given: frozenset[str] = frozenset()


_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainSettings)) - set(NOT_FLAGS)


def _flag_default(flag: Flag) -> Any:
    """What a parser gives for ``flag`` when it is not given (``False`` for a ``store_true``
    switch, ``True`` for a ``store_false`` one)."""
    switch = {"store_true": False, "store_false": True}.get(flag.kwargs.get("action"))
    return flag.kwargs.get("default", switch)


def flag_defaults() -> dict[str, Any]:
    """Every flag's default, as ``train``'s parser would give it without the flag."""
    values = {flag.dest: _flag_default(flag) for flag in (*FLAGS, *TRAIN_FLAGS)}
    values.update(COMMAND_DEFAULTS)
    return values


def settings_from_args(args: argparse.Namespace | TrainSettings) -> TrainSettings:
    """The typed settings of parsed flags: made once, where the command line is parsed.

    Args:
        args: a namespace of a parser extended by ``add_hybrid_args`` (the ``train`` command's
            or another command's); flags its parser did not define take ``train``'s defaults,
            attributes that are no ``train`` flag (the command's own) are left out. Settings
            are returned as they are.

    Returns:
        The settings, with :attr:`TrainSettings.given` the flags given on the command line.
    """
    if isinstance(args, TrainSettings):
        return args
    values = flag_defaults()
    values.update((name, value) for name, value in vars(args).items() if name in _FIELDS)
    return TrainSettings(**values, given=given_flags(args))


def require_settings(args: object, taker: str) -> TrainSettings:
    """``args`` if it is :class:`TrainSettings`; a TypeError naming the fix otherwise.

    Args:
        args: what a caller passed.
        taker: the function that takes the settings (for the message).

    Raises:
        TypeError: ``args`` is a parsed namespace or anything else.
    """
    if not isinstance(args, TrainSettings):
        raise TypeError(
            f"{taker} takes TrainSettings, got {type(args).__name__}: make them once from the "
            "parsed flags with settings_from_args(namespace)"
        )
    return args

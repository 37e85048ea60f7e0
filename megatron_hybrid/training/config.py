"""The ``TransformerConfig`` that the ``train`` and ``check-checkpoint`` flags describe.

``num_layers`` is the pattern's physical layer count, ``mtp_num_layers`` its MTP depth, and the
virtual pipeline size follows from its ``|`` segments.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_hybrid.pattern import GDN, MAMBA, MLA, MOE, ParsedPattern
from megatron_hybrid.training.arguments import (
    required_pattern,
    vpp_size_from_pattern,
    with_defaults,
)

__all__ = ["hybrid_config_from_args"]


def hybrid_config_from_args(args: argparse.Namespace, **overrides: Any):
    """The ``TransformerConfig`` described by parsed flags.

    Args:
        args: parsed flags (from a parser extended by :func:`add_hybrid_args`); flags the
            parser did not define take their defaults.
        **overrides: config fields to set on top (e.g. CPU-friendly fusion switches).

    Raises:
        ValueError: inconsistent flags, with what to change.
    """
    import torch
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    args = with_defaults(args)
    parsed = required_pattern(args)
    counts = parsed.layer_counts
    _check_model_flags(args, parsed)
    vpp = vpp_size_from_pattern(parsed, args.pipeline_model_parallel_size)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    kwargs: dict[str, Any] = dict(
        num_layers=parsed.physical_layer_count,
        mtp_num_layers=parsed.mtp_num_depths or None,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        ffn_hidden_size=ffn,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        # megatron-core's SequentialMLP experts fail with biases (in-place add on a view).
        add_bias_linear=not args.disable_bias_linear and not counts.get(MOE, 0),
        qk_layernorm=args.qk_layernorm,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        transformer_impl=args.transformer_impl,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        overlap_moe_expert_parallel_comm=args.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=args.delay_wgrad_compute,
    )
    kwargs.update(_layer_type_fields(args, counts, ffn))
    kwargs.update(overrides)
    return (MLATransformerConfig if counts.get(MLA, 0) else TransformerConfig)(**kwargs)


def _check_model_flags(args: argparse.Namespace, parsed: ParsedPattern) -> None:
    """What the pattern's layer types need from the flags, checked before the config is built."""
    counts = parsed.layer_counts
    if counts.get(MOE, 0) and not args.num_experts:
        raise ValueError(f"the pattern {parsed.pattern!r} has MoE ('E') layers; set --num-experts")
    if counts.get(GDN, 0) and not args.swiglu:
        raise ValueError(
            "GatedDeltaNet ('G') layers use the model's activation, which must be SiLU: "
            "add --swiglu"
        )
    if counts.get(MAMBA, 0):
        _check_mamba_sizes(args)
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")


def _check_mamba_sizes(args: argparse.Namespace) -> None:
    """Mamba heads and groups must split evenly (megatron-core's MambaMixer asserts it)."""
    d_inner = 2 * args.hidden_size  # MambaMixer's expand = 2
    if args.mamba_num_heads is None and d_inner % args.mamba_head_dim:
        raise ValueError(
            f"Mamba ('M') layers have 2 x --hidden-size = {d_inner} channels, not a multiple of "
            f"--mamba-head-dim {args.mamba_head_dim}; change --mamba-head-dim or set "
            "--mamba-num-heads"
        )
    heads = args.mamba_num_heads or d_inner // args.mamba_head_dim
    tp = args.tensor_model_parallel_size
    if heads % args.mamba_num_groups or args.mamba_num_groups % tp:
        raise ValueError(
            f"Mamba ('M') layers have {heads} heads in --mamba-num-groups "
            f"{args.mamba_num_groups} groups over TP {tp}: groups must divide the heads and TP "
            "must divide the groups; change --mamba-num-groups (or --mamba-num-heads)"
        )


def _layer_type_fields(args: argparse.Namespace, counts: dict[str, int], ffn: int) -> dict:
    """Config fields of the layer types the pattern uses (MoE, Mamba, GatedDeltaNet, MLA)."""
    kwargs: dict[str, Any] = {}
    if counts.get(MOE, 0):
        kwargs.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size or ffn,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_grouped_gemm=args.moe_grouped_gemm,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_flex_dispatcher_backend=args.moe_flex_dispatcher_backend,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        )
    if counts.get(MAMBA, 0):
        kwargs.update(
            mamba_state_dim=args.mamba_state_dim,
            mamba_head_dim=args.mamba_head_dim,
            mamba_num_groups=args.mamba_num_groups,
            mamba_num_heads=args.mamba_num_heads,
        )
    if counts.get(GDN, 0):
        kwargs.update(
            linear_num_key_heads=args.num_attention_heads,
            linear_num_value_heads=args.num_attention_heads,
            linear_key_head_dim=args.hidden_size // args.num_attention_heads,
            linear_value_head_dim=args.hidden_size // args.num_attention_heads,
        )
    if counts.get(MLA, 0):
        kwargs.update(
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_head_dim=args.qk_head_dim,
            qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
            v_head_dim=args.v_head_dim,
            # Plain RoPE: MLATransformerConfig's default (YaRN) needs long-context settings.
            rope_type="rope",
        )
    return kwargs

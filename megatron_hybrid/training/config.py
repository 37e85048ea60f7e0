"""The ``TransformerConfig`` that the ``train`` and ``check-checkpoint`` flags describe.

``num_layers`` is the pattern's physical layer count, ``mtp_num_layers`` its MTP depth, and the
virtual pipeline size follows from its ``|`` segments. What the flags must satisfy is checked by
the rule table (``training/validation.py``), not here: :func:`hybrid_config_from_args` applies
its ``model`` rules, and ``train`` all of them before anything is built. A model from Hugging
Face takes the conversion's model fields and :func:`training_fields` of the flags.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_hybrid.pattern import GDN, MAMBA, MLA, MOE, ParsedPattern
from megatron_hybrid.schedule.p2p import pipeline_p2p_fields
from megatron_hybrid.training.arguments import add_hybrid_args, required_pattern
from megatron_hybrid.training.parallel_rules import vpp_size_from_pattern
from megatron_hybrid.training.train_settings import TrainSettings, settings_from_args
from megatron_hybrid.training.validation import validate_settings

__all__ = ["hybrid_config_from_args", "training_fields"]


def hybrid_config_from_args(args: argparse.Namespace | TrainSettings, **overrides: Any):
    """The ``TransformerConfig`` described by parsed flags.

    Args:
        args: parsed flags (from a parser extended by :func:`add_hybrid_args`; flags the
            parser did not define take their defaults), or the typed settings made of them.
        **overrides: config fields to set on top (e.g. CPU-friendly fusion switches).

    Raises:
        SettingsError: a model rule of the rule table fails (the flag and the fix named).
        ValueError: the pattern's ``|`` segments do not fit the pipeline size.
    """
    import torch
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    args = settings_from_args(args)  # a public entry: a namespace of the caller's parser too
    validate_settings(args, scopes=("model",))
    parsed = required_pattern(args)
    counts = parsed.layer_counts
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
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(_layer_type_fields(args, counts, ffn))
    kwargs.update(training_fields(args, parsed))
    kwargs.update(overrides)
    return (MLATransformerConfig if counts.get(MLA, 0) else TransformerConfig)(**kwargs)


def training_fields(args: TrainSettings, parsed: ParsedPattern) -> dict[str, Any]:
    """The ``TransformerConfig`` fields the training flags decide, whatever the model: parallel
    layout (the virtual pipeline size from the pattern's ``|``), dtype, module implementation,
    recompute, EP overlap and the MoE run-time choices."""
    import torch

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    vpp = vpp_size_from_pattern(parsed, args.pipeline_model_parallel_size)
    return dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        **pipeline_p2p_fields(vpp),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        transformer_impl=args.transformer_impl,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        overlap_moe_expert_parallel_comm=args.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=args.delay_wgrad_compute,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_force_load_balancing=args.moe_router_force_load_balancing,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_flex_dispatcher_backend=args.moe_flex_dispatcher_backend,
    )


def _layer_type_fields(args: TrainSettings, counts: dict[str, int], ffn: int) -> dict:
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


def config_from_flags(pattern: str, *flags: str, **overrides: Any):
    """The ``TransformerConfig`` that ``train --hybrid-layer-pattern PATTERN FLAGS`` describes.

    For tests, benchmarks and notebooks that want ``train``'s model without its loop.

    Args:
        pattern: the layer pattern.
        *flags: further flags, as on the command line (``"--num-experts", "4"``).
        **overrides: config fields set on top (e.g. ``cpu_config_overrides()`` for a CPU run).

    Raises:
        ValueError: inconsistent flags, with what to change.
    """
    parser = argparse.ArgumentParser()
    add_hybrid_args(parser)
    args = parser.parse_args(["--hybrid-layer-pattern", pattern, *flags])
    return hybrid_config_from_args(args, **overrides)

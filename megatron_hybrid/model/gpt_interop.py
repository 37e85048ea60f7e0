"""The GPTModel that shares a grouped pattern's checkpoints.

For a pattern whose logical layers are all GPT-equivalent groups (``[*-]{3}[*E]{58}``), the
GPTModel config with one GPT layer per group — ``num_layers`` = logical layers, MoE placement
through ``moe_layer_freq`` — builds the same sharded state dict. These helpers derive that config
and spec, for migration in both directions and for the tests that hold the package to it.
"""

from __future__ import annotations

import dataclasses

from megatron_hybrid.checkpointing.equivalence import gpt_role_symbols, is_gpt_equivalent_group
from megatron_hybrid.modules.norms import TorchNorm
from megatron_hybrid.pattern import MLA, MOE, GptRole, ParsedPattern, parse_pattern

__all__ = ["NotGPTEquivalentError", "gpt_config_for_pattern", "gpt_decoder_spec_for_pattern"]


class NotGPTEquivalentError(ValueError):
    """The pattern has logical layers GPTModel cannot express."""


def _gpt_layers(pattern: str | ParsedPattern) -> ParsedPattern:
    parsed = parse_pattern(pattern)
    bad = [
        layer
        for layer in parsed.logical_layers
        if not (layer.is_group and is_gpt_equivalent_group(layer.members))
    ]
    if bad or not parsed.logical_layers:
        where = ", ".join(
            f"logical layer {layer.index} {''.join(layer.members)!r}" for layer in bad[:3]
        )
        raise NotGPTEquivalentError(
            f"pattern {parsed.pattern!r} is not GPT-equivalent ({where or 'no layers'}): every "
            "logical layer must be a group of one attention symbol ('*', '+' or 'D') followed "
            "by '-' or 'E', such as '[*E]'"
        )
    attention = {layer.members[0] for layer in parsed.logical_layers}
    if len(attention) > 1:
        raise NotGPTEquivalentError(
            f"pattern {parsed.pattern!r} mixes attention types {sorted(attention)}; GPTModel "
            "uses one attention type for all layers"
        )
    assert attention <= gpt_role_symbols(GptRole.ATTENTION)  # is_gpt_equivalent_group's rule
    return parsed


def gpt_config_for_pattern(config, pattern: str | ParsedPattern):
    """The GPTModel ``TransformerConfig`` whose checkpoints the grouped pattern shares.

    Args:
        config: the grouped model's config (``num_layers`` = physical layers).
        pattern: a GPT-equivalent pattern.

    Returns:
        A copy of ``config`` with ``num_layers`` = logical layers, ``moe_layer_freq`` describing
        which layers are MoE (an int 1 when all are, a 0/1 list when mixed) and
        ``mtp_num_layers`` kept.

    Raises:
        NotGPTEquivalentError: the pattern has layers GPTModel cannot express.
    """
    parsed = _gpt_layers(pattern)
    moe = [1 if layer.members[1] == MOE else 0 for layer in parsed.logical_layers]
    if all(moe):
        moe_layer_freq = 1
    elif any(moe):
        moe_layer_freq = moe
    else:
        moe_layer_freq = 1  # no MoE layer at all; GPT ignores the field without experts
    changes = dict(num_layers=parsed.logical_layer_count, moe_layer_freq=moe_layer_freq)
    if not any(moe):
        changes["num_moe_experts"] = None
    # The pipeline split of the grouped model comes from '|'; GPT needs it in layer counts.
    changes["num_layers_in_first_pipeline_stage"] = None
    changes["num_layers_in_last_pipeline_stage"] = None
    return dataclasses.replace(config, **changes)


def gpt_decoder_spec_for_pattern(
    gpt_config, pattern: str | ParsedPattern, backend: str = "local", vp_stage: int | None = None
):
    """GPTModel decoder block spec for :func:`gpt_config_for_pattern`'s config.

    Args:
        gpt_config: the GPT config.
        pattern: the grouped pattern (decides MLA).
        backend: ``"local"`` or ``"te"``.
        vp_stage: virtual pipeline stage of the model chunk.

    Returns:
        The spec from megatron-core's ``get_gpt_decoder_block_spec``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    parsed = _gpt_layers(pattern)
    if (parsed.logical_layers[0].members[0] == MLA) != bool(gpt_config.multi_latent_attention):
        raise ValueError(
            "the pattern's attention type and config.multi_latent_attention disagree: '+' "
            "layers need an MLA config, '*' layers a plain one"
        )
    spec = get_gpt_decoder_block_spec(
        gpt_config, use_transformer_engine=backend == "te", vp_stage=vp_stage
    )
    if backend == "local":
        _use_sequence_parallel_norms(spec)
    return spec


def _use_sequence_parallel_norms(block_spec) -> None:
    """Swap megatron's ``WrappedTorchNorm`` (no sequence parallelism) for :class:`TorchNorm`.

    Same modules, parameter names and initialisation, so checkpoints are unchanged; without apex,
    megatron-core's local GPT spec otherwise cannot run with sequence parallelism at all.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for layer_spec in block_spec.layer_specs:
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            if getattr(layer_spec.submodules, name, None) is WrappedTorchNorm:
                setattr(layer_spec.submodules, name, TorchNorm)
    if getattr(block_spec, "layer_norm", None) is WrappedTorchNorm:
        block_spec.layer_norm = TorchNorm

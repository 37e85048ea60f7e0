"""The checks of ``HybridModel``'s constructor arguments, before it builds anything: the
pattern from megatron-core's deprecated arguments, the config against the parsed pattern, the
spec and the pipeline, and the real vocabulary size."""

from __future__ import annotations

import logging

from megatron_hybrid.checks import check_int
from megatron_hybrid.pattern import virtual_stages

__all__ = ["check_config", "check_real_vocab_size", "resolve_pattern"]

logger = logging.getLogger(__name__)


def resolve_pattern(config, hybrid_layer_pattern, attention_ratio, mlp_ratio, override_pattern):
    """megatron-core's deprecated ways of giving a pattern, resolved to one string."""
    if override_pattern is not None:
        if hybrid_layer_pattern is not None:
            raise ValueError(
                "hybrid_override_pattern and hybrid_layer_pattern cannot both be set; "
                "hybrid_override_pattern is deprecated, pass hybrid_layer_pattern only"
            )
        logger.warning("hybrid_override_pattern is deprecated; use hybrid_layer_pattern")
        hybrid_layer_pattern = override_pattern
    if (attention_ratio or 0.0) > 0.0 or (mlp_ratio or 0.0) > 0.0:
        if hybrid_layer_pattern is not None:
            raise ValueError(
                "hybrid_layer_pattern cannot be combined with the deprecated "
                "hybrid_attention_ratio / hybrid_mlp_ratio; pass hybrid_layer_pattern only"
            )
        from megatron.core.models.hybrid.hybrid_layer_allocation import pattern_from_ratios

        logger.warning("hybrid_attention_ratio/hybrid_mlp_ratio are deprecated")
        hybrid_layer_pattern = pattern_from_ratios(
            config.num_layers, attention_ratio or 0.0, mlp_ratio or 0.0
        )
    if hybrid_layer_pattern is None:
        raise ValueError(
            "HybridModel needs hybrid_layer_pattern, e.g. '[*E]{4}' (see docs/pattern_grammar.md)"
        )
    return hybrid_layer_pattern


def check_config(config, parsed, spec, pp_size: int, vp_stage) -> None:
    """Refuse a config that does not fit the parsed pattern, the spec or the pipeline."""
    if config.num_layers != parsed.physical_layer_count:
        raise ValueError(
            f"TransformerConfig.num_layers={config.num_layers}, but the pattern "
            f"{parsed.pattern!r} has {parsed.physical_layer_count} physical layers (a group "
            f"like '[*E]' counts 2). Set num_layers={parsed.physical_layer_count}."
        )
    if parsed.mtp_num_depths and config.mtp_num_layers != parsed.mtp_num_depths:
        raise ValueError(
            f"the pattern {parsed.pattern!r} has {parsed.mtp_num_depths} MTP depth(s) but "
            f"TransformerConfig.mtp_num_layers={config.mtp_num_layers}; set "
            f"mtp_num_layers={parsed.mtp_num_depths}"
        )
    if not parsed.mtp_num_depths and config.mtp_num_layers:
        raise ValueError(
            f"TransformerConfig.mtp_num_layers={config.mtp_num_layers}, but the pattern "
            f"{parsed.pattern!r} has no MTP part; add one ('<main>/<mtp>') or unset "
            "mtp_num_layers"
        )
    if config.pipeline_model_parallel_layout is not None:
        raise ValueError(
            "pipeline_model_parallel_layout is not used by HybridModel: the pattern's '|' "
            "separators define the pipeline stages; unset the layout"
        )
    vpp = config.virtual_pipeline_model_parallel_size or 1
    if parsed.num_segments > 1 and virtual_stages(parsed, pp_size) != vpp:
        raise ValueError(
            f"the pattern {parsed.pattern!r} has {parsed.num_segments} '|'-separated segments, "
            f"but pipeline size {pp_size} x virtual pipeline size {vpp} = {pp_size * vpp}; "
            "use as many segments as pipeline stages times virtual stages"
        )
    if (vp_stage is not None) != (config.virtual_pipeline_model_parallel_size is not None):
        raise ValueError(
            "vp_stage must be given exactly when virtual_pipeline_model_parallel_size is set "
            f"(vp_stage={vp_stage}, virtual_pipeline_model_parallel_size="
            f"{config.virtual_pipeline_model_parallel_size})"
        )
    if parsed.layer_counts.get("E", 0) and config.add_bias_linear and not config.moe_grouped_gemm:
        # megatron-core 0.19.2 SequentialMLP adds the expert bias in place to the output of a
        # reduction autograd treats as a view: the first forward fails, so refuse it here.
        raise ValueError(
            f"the pattern {parsed.pattern!r} has MoE ('E') layers, whose experts (megatron-core's "
            "SequentialMLP) cannot have biases: set add_bias_linear=False"
        )
    spec_grouped = (spec.metainfo or {}).get("moe_grouped_gemm")
    if spec_grouped is not None and bool(spec_grouped) != bool(config.moe_grouped_gemm):
        raise ValueError(
            f"the spec was built with moe_grouped_gemm={spec_grouped} but the config has "
            f"moe_grouped_gemm={config.moe_grouped_gemm}; build it with "
            "hybrid_stack_spec(backend, config=config)"
        )


def check_real_vocab_size(real: int | None, vocab_size: int) -> int:
    """The tokenizer's vocabulary size (``vocab_size`` unless given), checked."""
    if real is None:
        return vocab_size
    check_int("real_vocab_size", real, where="HybridModel")
    if real > vocab_size:
        raise ValueError(
            f"HybridModel: real_vocab_size={real} exceeds vocab_size={vocab_size} (the padded "
            "vocabulary the embedding and output layer hold)"
        )
    return real

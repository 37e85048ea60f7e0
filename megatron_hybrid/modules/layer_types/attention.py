"""Runtime of ``*`` (attention): the attention half of a GPT ``TransformerLayer``."""

from __future__ import annotations

from megatron_hybrid.modules.flops import SequenceBatch, linear_flops
from megatron_hybrid.modules.layer_types.common import attention_half_runtime
from megatron_hybrid.pattern import ATTENTION


def flops(config, batch: SequenceBatch) -> dict[str, float]:
    """Forward FLOPs: QKV (and output-gate) projection, causal scores and weighted values (a
    sliding window limits the keys), output projection."""
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = config.kv_channels
    tokens, hidden = batch.tokens, config.hidden_size
    query_width = heads * head_dim * (2 if config.attention_output_gate else 1)
    pairs = batch.attended_pairs(config.window_size[0] if config.window_size else None)
    return {
        "qkv_proj": linear_flops(tokens, hidden, query_width + 2 * groups * head_dim),
        "scores": 2 * pairs * heads * head_dim,
        "weighted_values": 2 * pairs * heads * head_dim,
        "out_proj": linear_flops(tokens, heads * head_dim, hidden),
    }


RUNTIME = attention_half_runtime(ATTENTION, "attention_layer", flops=flops)

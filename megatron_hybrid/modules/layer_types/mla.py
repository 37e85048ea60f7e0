"""Runtime of ``+`` (multi-latent attention): an attention half of a GPT layer."""

from __future__ import annotations

from megatron_hybrid.modules.flops import SequenceBatch, linear_flops
from megatron_hybrid.modules.layer_types.common import attention_half_runtime
from megatron_hybrid.pattern import MLA


def projection_flops(config, tokens: int) -> dict[str, float]:
    """MLA's projections: queries (through the ``q_lora_rank`` bottleneck where set), the
    compressed key/value and shared rope key, their up-projection, the output projection."""
    heads, hidden = config.num_attention_heads, config.hidden_size
    qk_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
    if config.q_lora_rank is None:
        query = linear_flops(tokens, hidden, heads * qk_dim)
    else:
        query = linear_flops(tokens, hidden, config.q_lora_rank) + linear_flops(
            tokens, config.q_lora_rank, heads * qk_dim
        )
    return {
        "q_proj": query,
        "kv_down_proj": linear_flops(
            tokens, hidden, config.kv_lora_rank + config.qk_pos_emb_head_dim
        ),
        "kv_up_proj": linear_flops(
            tokens, config.kv_lora_rank, heads * (config.qk_head_dim + config.v_head_dim)
        ),
        "out_proj": linear_flops(tokens, heads * config.v_head_dim, hidden),
    }


def attention_flops(config, pairs: int) -> dict[str, float]:
    """Scores over query/key heads of ``qk_head_dim + qk_pos_emb_head_dim``, weighted values
    over ``v_head_dim``, for ``pairs`` attended (query, key) pairs."""
    heads = config.num_attention_heads
    qk_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
    return {
        "scores": 2 * pairs * heads * qk_dim,
        "weighted_values": 2 * pairs * heads * config.v_head_dim,
    }


def flops(config, batch: SequenceBatch) -> dict[str, float]:
    """Forward FLOPs of an MLA layer: projections and causal attention."""
    pairs = batch.attended_pairs(config.window_size[0] if config.window_size else None)
    return {**projection_flops(config, batch.tokens), **attention_flops(config, pairs)}


RUNTIME = attention_half_runtime(MLA, "mla_layer", flops=flops)

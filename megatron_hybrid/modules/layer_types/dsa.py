"""Runtime of ``D`` (DeepSeek sparse attention): an attention half of a GPT layer."""

from __future__ import annotations

from megatron_hybrid.modules.flops import SequenceBatch, linear_flops
from megatron_hybrid.modules.layer_types.common import attention_half_runtime
from megatron_hybrid.modules.layer_types.mla import attention_flops, projection_flops
from megatron_hybrid.pattern import DSA


def flops(config, batch: SequenceBatch) -> dict[str, float]:
    """Forward FLOPs: MLA's projections, the indexer (its query, key and head-weight
    projections and causal index scores), and attention over at most ``dsa_indexer_topk``
    selected keys per query."""
    tokens, hidden = batch.tokens, config.hidden_size
    index_heads, index_dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
    query_in = config.q_lora_rank or hidden
    selected = batch.attended_pairs(config.dsa_indexer_topk - 1)
    return {
        **projection_flops(config, tokens),
        "indexer_proj": linear_flops(tokens, query_in, index_heads * index_dim)
        + linear_flops(tokens, hidden, index_dim)
        + linear_flops(tokens, hidden, index_heads),
        "indexer_scores": 2 * batch.attended_pairs() * index_heads * index_dim,
        **attention_flops(config, selected),
    }


RUNTIME = attention_half_runtime(
    DSA,
    "dsa_layer",
    unverified="DeepSeek sparse attention has not been verified under CUDA graph capture",
    flops=flops,
)

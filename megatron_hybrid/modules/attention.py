"""Core attention of multi-latent attention (``+``) for the ``local`` backend.

megatron-core 0.19.2's local ``DotProductAttention`` assumes one head size for queries, keys and
values, and its constructor has no ``k_channels``/``v_channels``, which ``MLASelfAttention`` passes
(MLA's query/key heads are ``qk_head_dim + qk_pos_emb_head_dim`` wide, its value heads
``v_head_dim``). Only TransformerEngine's attention took them, so ``+`` could not run without TE,
and not at all on a CPU. :class:`MLACoreAttention` is that same unfused attention with the two
head sizes kept apart: scores ``q k^T * softmax_scale`` over the query/key size, the masked
softmax and dropout of ``DotProductAttention``, and the output over the value size.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import divide

__all__ = ["MLACoreAttention"]


class MLACoreAttention(DotProductAttention):
    """``DotProductAttention`` with separate query/key and value head sizes (MLA, local).

    Args:
        config: the model's (MLA) TransformerConfig.
        layer_number: 1-based layer number.
        attn_mask_type: mask type (causal for decoders).
        attention_type: ``"self"``.
        attention_dropout: dropout probability (default: the config's).
        softmax_scale: score scale; MLA passes its own (YaRN's mscale included).
        k_channels: query/key head size.
        v_channels: value head size.
        cp_comm_type: context-parallel communication type (context parallelism is refused).
        pg_collection: process groups.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        if config.context_parallel_size != 1:
            raise ValueError(
                "multi-latent attention ('+') on the 'local' backend has no context parallelism; "
                "use the 'te' backend or context_parallel_size=1"
            )
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        if softmax_scale is None and k_channels is not None:
            self.softmax_scale = k_channels**-0.5
        v_channels = v_channels or config.kv_channels
        # The output is [sq, b, heads_per_partition * v_channels]; only this size depends on
        # the value head size (the score matmul takes the query/key size from its inputs).
        self.hidden_size_per_attention_head_v = v_channels
        self.hidden_size_per_partition = divide(
            config.num_attention_heads * v_channels, self.tp_group.size()
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kwargs):
        """Unfused attention; ``query``/``key`` ``[s, b, np, hk]``, ``value`` ``[s, b, np, hv]``."""
        if kwargs.get("packed_seq_params") is not None:
            raise ValueError(
                "multi-latent attention ('+') on the 'local' backend takes no packed (THD) "
                "batches; use padded batches or the 'te' backend"
            )
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * value.size(-1)
        return super().forward(query, key, value, attention_mask, attn_mask_type, **kwargs)

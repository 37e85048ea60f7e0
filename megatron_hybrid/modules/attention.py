"""Core attention of the ``local`` backend: packed (THD) batches, and MLA's two head sizes.

megatron-core 0.19.2's local ``DotProductAttention`` (``transformer/dot_product_attention.py``)
asserts ``packed_seq_params is None``: only TransformerEngine's attention took packed batches, so
with the local backend (and on a CPU) ``*`` and ``+`` could not pack. :class:`LocalCoreAttention`
is that same unfused attention (scores, scale, masked softmax, dropout, output) that also takes a
THD batch: each packed sequence attends causally to itself only (block-diagonal causal), through
the very computation a separate ``[L_i, 1, ...]`` batch of that sequence gets, so a packed
sequence's output equals the output of that sequence run alone.

Where a sequence lies in the packed row comes from ``cu_seqlens_*_padded`` when given (physical
offsets, alignment padding after each sequence's real tokens) and its real length from
``cu_seqlens_*``, as TransformerEngine reads them. Padding positions attend to nothing and get a
zero output; they are never keys of a real token.

:class:`MLACoreAttention` is the same attention with MLA's separate query/key and value head
sizes: megatron-core's ``DotProductAttention`` assumes one head size and has no
``k_channels``/``v_channels``, which ``MLASelfAttention`` passes.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import divide

__all__ = ["LocalCoreAttention", "MLACoreAttention", "thd_segments"]


def thd_segments(packed_seq_params, total: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every packed sequence's real tokens in a THD row of ``total``.

    ``start`` is the physical offset (``cu_seqlens_q_padded`` when set, else ``cu_seqlens_q``),
    ``length`` the real length (from ``cu_seqlens_q``).

    Raises:
        ValueError: the boundaries do not describe ``total`` positions, queries and keys are
            packed differently, or a sequence is longer than its padded slot.
    """
    real = packed_seq_params.cu_seqlens_q
    padded = packed_seq_params.cu_seqlens_q_padded
    padded = real if padded is None else padded
    kv_real = packed_seq_params.cu_seqlens_kv
    kv_padded = packed_seq_params.cu_seqlens_kv_padded
    if (kv_real is not None and not torch.equal(kv_real.cpu(), real.cpu())) or (
        kv_padded is not None and not torch.equal(kv_padded.cpu(), padded.cpu())
    ):
        raise ValueError(
            "packed self-attention needs cu_seqlens_kv(_padded) equal to cu_seqlens_q(_padded); "
            "the local core attention packs queries and keys alike"
        )
    starts, lengths = padded.tolist(), torch.diff(real).tolist()
    if len(starts) != len(lengths) + 1 or starts[-1] != total:
        raise ValueError(
            f"packed_seq_params describe {starts[-1]} positions in {len(lengths)} sequences, "
            f"but the packed row holds {total}; build them with the plan that packed the row"
        )
    slots = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    if any(n < 0 or n > slot for n, slot in zip(lengths, slots, strict=True)):
        raise ValueError(
            f"a packed sequence is longer than its slot: real lengths {lengths}, slots {slots} "
            "(cu_seqlens_q vs cu_seqlens_q_padded)"
        )
    return list(zip(starts[:-1], lengths, strict=True))


class LocalCoreAttention(DotProductAttention):
    """megatron-core's unfused ``DotProductAttention``, also for packed (THD) batches.

    Padded (``[s, b, np, hn]``) input is megatron-core's computation unchanged. THD input
    (``[t, np, hn]``, as megatron's ``Attention`` passes it with ``qkv_format="thd"``) runs the
    same computation once per packed sequence with a causal mask and returns ``[t, np * hn]``;
    context parallelism is refused, as megatron-core refuses it for the local attention.
    """

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """Attention over ``[s, b, np, hn]`` (padded) or ``[t, np, hn]`` (THD) inputs."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        if attention_mask is not None:
            raise ValueError(
                "packed (THD) attention takes its boundaries from cu_seqlens; pass "
                "attention_mask=None"
            )
        if self.attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(
                f"packed (THD) attention of the local backend is causal; got {self.attn_mask_type}"
            )
        total = query.size(0)
        out = query.new_zeros(total, self.hidden_size_per_partition)
        for start, length in thd_segments(packed_seq_params, total):
            if length == 0:
                continue
            window = slice(start, start + length)
            # One sequence as a [L, 1, np, hn] batch: exactly the computation it gets alone.
            out[window] = (
                super()
                .forward(
                    query[window].unsqueeze(1),
                    key[window].unsqueeze(1),
                    value[window].unsqueeze(1),
                    self._causal_mask(length, query.device),
                    attention_bias=attention_bias,
                )
                .squeeze(1)
            )
        return out

    def _causal_mask(self, length: int, device) -> torch.Tensor | None:
        """The ``[1, 1, L, L]`` mask (True: hidden) the softmax needs to be causal, or None.

        megatron-core's ``FusedScaleMaskSoftmax`` builds the causal (or sliding-window) mask
        itself only for ``AttnMaskType.causal`` or a window; under ``padding_causal`` it expects
        the caller's mask and without one would let every token see its whole sequence.
        """
        softmax = self.scale_mask_softmax
        if softmax.attn_mask_type == AttnMaskType.causal or softmax.window_size is not None:
            return None
        return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]


class MLACoreAttention(LocalCoreAttention):
    """:class:`LocalCoreAttention` with separate query/key and value head sizes (MLA, local).

    Scores ``q k^T * softmax_scale`` over the query/key size, the masked softmax and dropout of
    ``DotProductAttention``, and the output over the value size.

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
        """Unfused attention; ``query``/``key`` ``[..., np, hk]``, ``value`` ``[..., np, hv]``."""
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * value.size(-1)
        return super().forward(query, key, value, attention_mask, attn_mask_type, **kwargs)

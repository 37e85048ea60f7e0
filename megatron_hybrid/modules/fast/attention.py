"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core 0.19.2's local ``DotProductAttention`` materialises the ``[b * heads, s, s]``
score matrix (``baddbmm``), masks and softmaxes it in float32 and multiplies it with the values:
at sequence 4096 that is 32 MiB of scores per head and several passes over them. SDPA computes
the same function in one fused kernel where one applies (FlashAttention-2, cuDNN or
memory-efficient attention on CUDA; a tiled math kernel on the CPU) and picks the kernel itself.

:class:`SDPACoreAttention` (``*``) and :class:`SDPAMLACoreAttention` (``+``, separate query/key
and value head sizes) subclass the package's reference classes, so parameters, buffers, the
checkpoint and the constructor are theirs; only ``forward`` changes. Before each call
:func:`~megatron_hybrid.modules.fast.selection.sdpa_reason` decides whether SDPA can compute
it; otherwise the reference forward runs and the reason is kept in ``fast_path_reason``.

Packed (THD) batches run one call of torch's varlen FlashAttention (``torch.nn.attention.varlen``;
``MEGATRON_HYBRID_VARLEN=0`` turns it off) where it applies (bf16 or fp16 on CUDA, one head
size, no dropout: :func:`~megatron_hybrid.modules.fast.selection.varlen_reason`), else one SDPA
call per sequence on the host copy of ``cu_seqlens`` (read once per micro-batch: the layers of
one forward share the tensor, so the copy is cached by tensor); ``cu_seqlens_q_padded`` places
each sequence, and padding rows between sequences get zero output. Fixed-size boundaries (CUDA
graphs' inputs, :mod:`~megatron_hybrid.padding.fixed`) go to the varlen kernel with nothing
read on the host; where it does not apply they are read uncached (a graph's inputs change in
place), which a capture refuses.
"""

from __future__ import annotations

import functools
import itertools

import torch
from megatron.core.transformer.attention import SelfAttention
from torch.nn import functional

from megatron_hybrid.modules.attention import LocalCoreAttention, MLACoreAttention
from megatron_hybrid.modules.fast.rope import apply_rope, apply_rope_thd
from megatron_hybrid.modules.fast.selection import (
    is_causal_mask,
    probing_backward,
    rope_reason,
    sdpa_reason,
    varlen_parameters,
    varlen_reason,
)
from megatron_hybrid.padding.batch import host_values
from megatron_hybrid.padding.fixed import FixedPackedSeqParams, rope_restart, row_segments

__all__ = [
    "FastSelfAttention",
    "SDPACoreAttention",
    "SDPAMLACoreAttention",
    "packed_attention_per_sequence",
    "sdpa_attention",
    "sdpa_packed_attention",
    "varlen_call",
    "varlen_probe",
]

# SDPA is a builtin without an introspectable signature; enable_gqa came in torch 2.5.
_HAS_ENABLE_GQA = "enable_gqa" in (functional.scaled_dot_product_attention.__doc__ or "")


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    keep_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """SDPA on megatron's ``[s, b, heads, dim]`` layout; returns ``[sq, b, heads * dim_v]``.

    Key/value heads fewer than query heads (grouped-query attention) are shared by consecutive
    query heads, as megatron's ``repeat_interleave`` shares them.

    Args:
        query: ``[sq, b, heads, dim_qk]``.
        key: ``[sk, b, groups, dim_qk]``.
        value: ``[sk, b, groups, dim_v]``.
        scale: factor on the scores.
        causal: causal mask (``sq == sk``).
        keep_mask: boolean ``[b | 1, heads | 1, sq, sk]``, True where a query may see a key.
        dropout_p: dropout probability on the attention weights.
    """
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    kwargs = {}
    if k.shape[1] != q.shape[1]:
        if _HAS_ENABLE_GQA:
            kwargs["enable_gqa"] = True
        else:  # torch < 2.5
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = functional.scaled_dot_product_attention(
        q, k, v, attn_mask=keep_mask, dropout_p=dropout_p, is_causal=causal, scale=scale, **kwargs
    )
    sq, batch = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(sq, batch, -1)


def sdpa_packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed_seq_params,
    *,
    scale: float,
    causal: bool,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention within each packed sequence of a THD batch; returns ``[t, heads * dim_v]``.

    One call of torch's varlen FlashAttention over the whole row where
    :func:`~megatron_hybrid.modules.fast.selection.varlen_reason` allows it, else one SDPA call
    per sequence (:func:`packed_attention_per_sequence`). Pad rows get zero output either way.
    Fixed-size boundaries (:class:`~megatron_hybrid.padding.fixed.FixedPackedSeqParams`, which
    CUDA graphs replay) go to the varlen kernel without a host read; where it does not apply,
    the per-sequence calls read them on the host (eager only: a graph capture of that fails and
    says so).

    Args:
        query: ``[t, heads, dim_qk]``.
        key: ``[t, groups, dim_qk]``.
        value: ``[t, groups, dim_v]``.
        packed_seq_params: megatron's ``PackedSeqParams`` (``cu_seqlens_q`` and, where
            sequences are padded apart, ``cu_seqlens_q_padded``).
        scale: factor on the scores.
        causal: causal mask within each sequence.
        dropout_p: dropout probability on the attention weights.
    """
    read = host_values
    if isinstance(packed_seq_params, FixedPackedSeqParams):
        out = _varlen_fixed(query, key, value, packed_seq_params, scale, causal, dropout_p)
        if out is not None:
            return out
        # A graph's inputs, whose values change in place: read, never kept.
        read = torch.Tensor.tolist
    lengths = read(packed_seq_params.cu_seqlens_q)
    padded = packed_seq_params.cu_seqlens_q_padded
    starts = read(padded) if padded is not None else lengths
    total = query.shape[0]
    gaps = starts != lengths or starts[-1] < total
    reason = varlen_reason(query, value, causal=causal, dropout_p=dropout_p, gaps=gaps)
    if reason is None and varlen_probe(query.device, query.dtype) is None:
        cu_seqlens = packed_seq_params.cu_seqlens_q
        offsets = padded if padded is not None else cu_seqlens
        return _varlen_packed(query, key, value, offsets, cu_seqlens, lengths, starts,
                              scale=scale, causal=causal)  # fmt: skip
    return packed_attention_per_sequence(
        query, key, value, lengths, starts, scale=scale, causal=causal, dropout_p=dropout_p
    )


def packed_attention_per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: list[int],
    starts: list[int] | None = None,
    *,
    scale: float,
    causal: bool,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """One SDPA call per packed sequence (THD); returns ``[t, heads * dim_v]``.

    ``lengths`` are the host values of ``cu_seqlens`` (real tokens), ``starts`` those of the
    padded offsets where sequences are padded apart (None: they are not); rows outside the
    sequences get zero output.
    """
    starts = lengths if starts is None else starts
    total = query.shape[0]
    width = query.shape[1] * value.shape[-1]
    pieces, position = [], 0
    for index in range(len(lengths) - 1):
        start, length = starts[index], lengths[index + 1] - lengths[index]
        if not length:  # an empty sequence (fixed-size boundaries end with them)
            continue
        if start > position:
            pieces.append(query.new_zeros(start - position, width))
        part = slice(start, start + length)
        out = sdpa_attention(
            query[part].unsqueeze(1),
            key[part].unsqueeze(1),
            value[part].unsqueeze(1),
            scale=scale,
            causal=causal,
            dropout_p=dropout_p,
        )
        pieces.append(out.squeeze(1))
        position = start + length
    if position < total:
        pieces.append(query.new_zeros(total - position, width))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def varlen_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    offsets: torch.Tensor,
    max_length: int,
    *,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` over the segments ``offsets`` (int32, on the
    device, ending at the row's length) of ``[t, heads, dim]`` tensors; ``[t, heads * dim]``.

    Speaks both signatures torch has had (``is_causal``; later ``window_size=(-1, 0)``) and
    shares key/value heads as megatron's ``repeat_interleave`` does (``enable_gqa`` where it
    exists).
    """
    from torch.nn.attention.varlen import varlen_attn

    names = varlen_parameters()
    kwargs = {"scale": scale}
    if "window_size" in names:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:
            repeat = query.shape[1] // key.shape[1]
            key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    offsets = offsets.to(torch.int32)
    out = varlen_attn(q, k, v, offsets, offsets, max_length, max_length, **kwargs)
    return out.reshape(query.shape[0], -1)


def _varlen_packed(query, key, value, offsets, cu_seqlens, lengths, starts, *, scale, causal):
    """:func:`varlen_call` over a THD row whose sequences start at ``starts`` (host values of
    the device tensor ``offsets``) with the real tokens of ``cu_seqlens`` (device; ``lengths``
    its host values): each segment holds a sequence and its pad rows (the last one too, if rows
    follow the last sequence), whose output is then zeroed. Under the causal mask (required
    where there are pad rows) no real token sees a pad row. No host-to-device copy: the rows to
    keep are found from the device offsets."""
    total = query.shape[0]
    bounds = list(starts)
    if bounds[-1] < total:  # rows after the last sequence: one more segment, all padding
        offsets = torch.cat([offsets, offsets.new_full((1,), total)])
        bounds.append(total)
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    out = varlen_call(query, key, value, offsets, longest, scale=scale, causal=causal)
    if bounds == lengths:
        return out
    real = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    real = torch.cat([real, real.new_zeros(len(bounds) - len(lengths))])
    return _zero_pad_rows(out, offsets, real)


def _varlen_fixed(query, key, value, params, scale, causal, dropout_p) -> torch.Tensor | None:
    """:func:`varlen_call` over fixed-size boundaries (every segment a sequence and its pad
    rows, then empty ones), reading nothing on the host; None where the varlen kernel does not
    apply. The longest segment is bounded by the row's length, which is what the kernel is told
    (it only sizes its grid by it)."""
    if params.total_tokens != query.shape[0]:  # their segments would not cover this row
        raise ValueError(
            f"fixed-size packed boundaries of a row of {params.total_tokens} tokens given "
            f"{query.shape[0]} rows; make them from this micro-batch's PackedSeqParams "
            "(total_tokens = its row's length)"
        )
    reason = varlen_reason(query, value, causal=causal, dropout_p=dropout_p, gaps=True)
    if reason is not None or varlen_probe(query.device, query.dtype) is not None:
        return None
    offsets, cu_seqlens = params.cu_seqlens_q_padded, params.cu_seqlens_q
    out = varlen_call(query, key, value, offsets, query.shape[0], scale=scale, causal=causal)
    return _zero_pad_rows(out, offsets, (cu_seqlens[1:] - cu_seqlens[:-1]).long())


def _zero_pad_rows(out: torch.Tensor, offsets: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``out`` (``[t, width]``) with every row of segment ``i`` (``offsets[i]`` on) past its first
    ``real[i]`` rows zeroed, found on the device."""
    # Row r of segment i is real if r - start_i < real_i; empty segments own no row.
    segment_starts = offsets[:-1].long()
    rows = torch.arange(out.shape[0], device=out.device)
    segment = row_segments(segment_starts, rows)
    keep = (rows - segment_starts[segment]) < real[segment]
    return out.masked_fill(~keep.unsqueeze(1), 0.0)


@functools.cache
def varlen_probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why :func:`varlen_call` cannot stand for :func:`packed_attention_per_sequence` on
    ``device`` (a tensor's, with its index) in ``dtype``, or None: checked once per device and
    dtype, forward and backward (two sequences, grouped-query heads, causal; bf16 rounding
    apart), before the first varlen call there. On any failure the per-sequence calls run."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(16, heads, 64, generator=gen) for heads in (4, 2, 2)]
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=device)
    calls = (
        lambda q, k, v: varlen_call(q, k, v, cu, 11, scale=0.125, causal=True),
        lambda q, k, v: packed_attention_per_sequence(q, k, v, [0, 5, 16], scale=0.125,
                                                      causal=True),  # fmt: skip
    )
    results = []
    try:
        for attend in calls:
            with probing_backward():
                leaves = [t.to(device, dtype).requires_grad_() for t in tensors]
                out = attend(*leaves)
                out.float().square().sum().backward()
            results.append([out.detach().float(), *(t.grad.float() for t in leaves)])
    except Exception as error:  # noqa: BLE001 - whatever fails here, the per-sequence calls run
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        return f"torch's varlen_attn does not run on {device} in {dtype}: {first_line}"
    for name, got, want in zip(("output", "dq", "dk", "dv"), *results, strict=True):
        error = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        if not error <= 2e-2:  # bf16: about 2^-8 per rounding, a few roundings apart
            return f"torch's varlen_attn differs from SDPA in its {name} ({error:.1e} relative)"
    return None


class _SDPAForward:
    """``forward`` through SDPA where :func:`sdpa_reason` allows it, else the reference's."""

    fast_path_reason: str | None = "not run"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        **kwargs,
    ) -> torch.Tensor:
        """Core attention; ``[sq, b, heads, dim]`` in, ``[sq, b, heads * dim_v]`` out (THD:
        ``[t, heads, dim]`` in, ``[t, heads * dim_v]`` out)."""
        reason = sdpa_reason(
            self, query, key, attention_mask, attention_bias, attn_mask_type, packed_seq_params
        )
        self.fast_path_reason = reason
        if reason is not None:
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
                **kwargs,
            )
        # FusedScaleMaskSoftmax multiplies the (already divided) scores by the layer-number
        # coefficient again when apply_query_key_layer_scaling is on: the net scale is this.
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        causal = is_causal_mask(attn_mask_type or self.attn_mask_type)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":

            def attend():
                return sdpa_packed_attention(
                    query, key, value, packed_seq_params, scale=scale, causal=causal,
                    dropout_p=dropout_p,
                )  # fmt: skip

        else:
            keep = None if attention_mask is None else ~attention_mask
            causal = causal and attention_mask is None

            def attend():
                return sdpa_attention(
                    query, key, value, scale=scale, causal=causal, keep_mask=keep,
                    dropout_p=dropout_p,
                )  # fmt: skip

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # The reference draws its dropout mask inside the model-parallel RNG fork.
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return attend()
        return attend()


class SDPACoreAttention(_SDPAForward, LocalCoreAttention):
    """The package's local core attention (``*``; megatron-core's ``DotProductAttention`` with
    packed input) computed through SDPA.

    Fixed-size packed boundaries run one varlen call with no host read (CUDA graphs replay it:
    ``GraphPiece.packed``).
    """

    reads_fixed_packed_on_device = True


class SDPAMLACoreAttention(_SDPAForward, MLACoreAttention):
    """The package's MLA core attention (``+``) computed through SDPA: query/key heads of
    ``qk_head_dim + qk_pos_emb_head_dim``, value heads of ``v_head_dim`` (on packed rows
    megatron-core 0.19.2 pads them to the query's width before the core attention,
    ``_prepare_mla_core_attention_value``, so the varlen kernel takes them too)."""

    reads_fixed_packed_on_device = True


class FastSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` with the rotary embedding of :func:`apply_rope` (packed
    rows: :func:`apply_rope_thd`, no host read).

    ``forward`` hands the rotary frequencies to :meth:`get_query_key_value_tensors`, which
    rotates the query and key as soon as they exist (after the q/k norms, where megatron rotates
    them too), and runs megatron's forward without them; where
    :func:`~megatron_hybrid.modules.fast.selection.rope_reason` says otherwise, megatron's own
    RoPE runs (``fast_path_reason``).
    """

    fast_path_reason: str | None = "not run"
    _pending_rope = None
    #: Its RoPE reads packed boundaries on the device (``GraphPiece.packed``).
    reads_fixed_packed_on_device = True

    def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
        """megatron's ``SelfAttention.forward``; its layers pass ``rotary_pos_emb`` by keyword."""
        no_rope = self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]
        inference = kwargs.get("inference_context") or kwargs.get("inference_params")
        reason = rope_reason(
            self, None if no_rope else rotary_pos_emb, kwargs.get("packed_seq_params"), inference
        )
        self.fast_path_reason = None if reason == "no rotary embedding" else reason
        if reason is not None:
            return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        if not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
        # Packed rows: each side's offsets, as megatron picks them (padded ones where given).
        packed = kwargs.get("packed_seq_params")
        offsets = (None, None)
        if packed is not None and packed.qkv_format == "thd":
            offsets = (
                _first(packed.cu_seqlens_q_padded, packed.cu_seqlens_q),
                _first(packed.cu_seqlens_kv_padded, packed.cu_seqlens_kv),
            )
        self._pending_rope = (*rotary_pos_emb, *offsets, rope_restart(packed))
        try:
            return super().forward(hidden_states, *args, rotary_pos_emb=None, **kwargs)
        finally:
            self._pending_rope = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        """megatron's query, key and value (and gate), the query and key rotated if pending."""
        out = super().get_query_key_value_tensors(*args, **kwargs)
        pending, self._pending_rope = self._pending_rope, None
        if pending is None:
            return out
        mscale = self._yarn_concentration_factor
        q_freqs, k_freqs, q_offsets, k_offsets, restart = pending
        query, key = out[0], out[1]
        if q_freqs is not None:
            query = _rope(query, q_freqs, q_offsets, mscale, restart)
        if k_freqs is not None:
            key = _rope(key, k_freqs, k_offsets, mscale, restart)
        return (query, key, *out[2:])


def _first(*values):
    return next((v for v in values if v is not None), None)


def _rope(t, freqs, offsets, mscale, restart):
    """RoPE of a padded batch, or of a packed row at its sequences' ``offsets``."""
    if offsets is None:
        return apply_rope(t, freqs, mscale)
    return apply_rope_thd(t, freqs, offsets, mscale, restart)

"""Rotary position embedding in three kernels each way, its tables computed once per forward.

megatron-core 0.19.2 applies RoPE without TransformerEngine through ``_apply_rotary_pos_emb_bshd``
(``models/common/embeddings/rope_utils.py``): per tensor and layer it recomputes ``cos`` and
``sin`` of the frequencies, scales and casts them, slices the rotated part off, negates and
concatenates half of it, multiplies twice, adds and concatenates the rest back: about a dozen
kernels forward and as many backward (the slice's gradient is a zero fill and a copy), for the
query and again for the key of every attention layer.

:func:`apply_rope` computes the same ``t cos + rotate_half(t) sin``: the tables
``cos`` and ``sin`` (scaled, in the tensor's dtype, ``sin`` with its first half negated so that
the rotation is a swap of halves) are built once per frequency tensor, which every layer of a
forward shares (megatron's ``RotaryEmbedding`` even caches it across steps), and the rotation
is a concatenation and a fused multiply-add: ``t * cos`` then ``addcmul`` forward, the mirror
image backward (swapping halves is its own transpose).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["apply_rope", "rope_tables"]

_TABLES: dict[int, tuple[weakref.ref, dict]] = {}


def _build(freqs: torch.Tensor, dtype: torch.dtype, mscale: float):
    half = freqs.shape[-1] // 2
    cos = (torch.cos(freqs) * mscale).to(dtype)
    sin = (torch.sin(freqs) * mscale).to(dtype)
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0):
    """``(cos, signed sin)`` of ``freqs`` in ``dtype``, kept for as long as ``freqs`` lives (and
    is not modified); rebuilt, not kept, during CUDA-graph capture (so a replay recomputes
    them from the graph's input)."""
    if freqs.is_cuda and torch.cuda.is_current_stream_capturing():
        return _build(freqs, dtype, mscale)
    key = id(freqs)
    entry = _TABLES.get(key)
    if entry is None or entry[0]() is not freqs:
        entry = (weakref.ref(freqs, lambda _, key=key: _TABLES.pop(key, None)), {})
        _TABLES[key] = entry
    tables = entry[1]
    spec = (dtype, float(mscale), freqs._version)
    if spec not in tables:
        tables.clear()  # a new version or dtype replaces the old tables
        tables[spec] = _build(freqs, dtype, mscale)
    return tables[spec]


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class _Rope(torch.autograd.Function):
    """``t * cos + swap_halves(t) * signed_sin`` (the tables take no gradient)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        ctx.save_for_backward(cos, signed_sin)
        return torch.addcmul(t * cos, _swap_halves(t), signed_sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, signed_sin = ctx.saved_tensors
        return torch.addcmul(_swap_halves(grad * signed_sin), grad, cos), None, None


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """megatron's non-interleaved RoPE of ``t`` ``[s, b, heads, dim]`` with ``freqs``
    ``[s, 1 | b, 1, rot]``: the first ``rot`` channels rotated, the rest passed through."""
    cos, signed_sin = rope_tables(freqs, t.dtype, mscale)
    rot = freqs.shape[-1]
    if rot == t.shape[-1]:
        return _Rope.apply(t, cos, signed_sin)
    return torch.cat((_Rope.apply(t[..., :rot], cos, signed_sin), t[..., rot:]), dim=-1)

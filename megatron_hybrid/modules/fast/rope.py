"""Rotary position embedding in one kernel each way on CUDA, its tables computed once per forward.

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
is one Triton kernel each way on CUDA (:func:`rope_kernel_reason`): ``t cos + swap(t) sin``
forward and ``g cos + swap(g sin)`` backward (swapping halves is its own transpose) in float32,
rounded once, the channels past the rotated ones copied; elsewhere a concatenation and a fused
multiply-add, ``t * cos`` then ``addcmul``, three kernels each way.

Packed (THD) rows: megatron's ``_apply_rotary_pos_emb_thd`` reads the sequence lengths and the
total on the host (``.tolist()``, ``.item()``: a wait for the GPU in every attention layer of
every micro-batch) and rotates one sequence at a time. :func:`apply_rope_thd` computes each
token's position on the device from ``cu_seqlens`` (one ``searchsorted``, cached per
``cu_seqlens`` tensor and version, which every layer of a micro-batch shares; not while a CUDA
graph captures, so that a replay computes them from the graph's inputs), gathers the tables at
those positions and rotates the whole row at once. Positions restart in every sequence, except
where megatron's frequencies cover the whole packed row (``freqs`` as long as the row: its
"exact mapping" case), where a token's position is its index in the row, as in megatron;
callers with fixed-size boundaries (CUDA graphs) pass ``restart=True``, their table being sized
by the row.
"""

from __future__ import annotations

import weakref

import torch

from megatron_hybrid.padding.batch import per_tensor
from megatron_hybrid.padding.fixed import row_segments
from megatron_hybrid.triton_lazy import lazy_triton

__all__ = ["apply_rope", "apply_rope_thd", "rope_kernel_reason", "rope_tables", "thd_positions"]

_TABLES: dict[int, tuple[weakref.ref, dict]] = {}
_THD: dict[int, tuple[weakref.ref, dict]] = {}


def _build(freqs: torch.Tensor, dtype: torch.dtype, mscale: float):
    half = freqs.shape[-1] // 2
    cos = (torch.cos(freqs) * mscale).to(dtype)
    sin = (torch.sin(freqs) * mscale).to(dtype)
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0):
    """``(cos, signed sin)`` of ``freqs`` in ``dtype``, kept for as long as ``freqs`` lives (and
    is not modified); rebuilt, not kept, during CUDA-graph capture (so a replay recomputes
    them from the graph's input)."""
    if _capturing(freqs):
        return _build(freqs, dtype, mscale)
    tables = per_tensor(_TABLES, freqs)
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


@lazy_triton
def _kernel(triton, tl):
    """The Triton rotation kernel, or None where Triton cannot be imported."""

    @triton.jit
    def rope_kernel(
        t_ptr, cos_ptr, sin_ptr, out_ptr, batch, heads, dim, rot,
        t_s, t_b, t_h, table_s, table_b,
        BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        s, b = row // batch, row % batch
        head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        col = tl.arange(0, BLOCK_D)
        half = rot // 2
        rotated = col < rot
        swapped = tl.where(col < half, col + half, col - half)
        swapped = tl.where(rotated, swapped, col)
        mask = (head[:, None] < heads) & (col[None, :] < dim)
        base = t_ptr + s * t_s + b * t_b + head[:, None] * t_h
        x = tl.load(base + col[None, :], mask=mask, other=0.0).to(tl.float32)
        x_swapped = tl.load(base + swapped[None, :], mask=mask, other=0.0).to(tl.float32)
        table = s * table_s + b * table_b
        cos = tl.load(cos_ptr + table + col, mask=rotated, other=1.0).to(tl.float32)
        # Forward: t cos + swap(t) sin; backward (its transpose): g cos + swap(g sin).
        sin_col = swapped if BACKWARD else col
        sin = tl.load(sin_ptr + table + sin_col, mask=rotated, other=0.0).to(tl.float32)
        out = tl.where(rotated[None, :], x * cos[None, :] + x_swapped * sin[None, :], x)
        where = out_ptr + row * heads * dim + head[:, None] * dim + col[None, :]
        tl.store(where, out.to(out_ptr.dtype.element_ty), mask=mask)

    return rope_kernel, triton.cdiv, triton.next_power_of_2


def rope_kernel_reason(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> str | None:
    """Why the rotation of ``t`` ``[s, b, heads, dim]`` by tables ``[s, 1 | b, 1, rot]`` runs
    as torch operators rather than one Triton kernel each way (None: the kernel).

    The kernel reads both tables at ``cos``'s strides, so ``signed_sin`` must lie as ``cos``
    does (:func:`rope_tables` makes it contiguous; ``cos`` follows the frequencies' layout)."""
    if t.dim() != 4 or cos.dim() != 4 or t.stride(-1) != 1 or cos.stride(-1) != 1:
        return "not [s, b, heads, dim] with a contiguous last dimension"
    rot = cos.shape[-1]
    if cos.shape[0] != t.shape[0] or cos.shape[1] not in (1, t.shape[1]) or cos.shape[2] != 1:
        return f"tables of shape {tuple(cos.shape)} for {tuple(t.shape)}"
    if rot % 2 or rot > t.shape[-1]:
        return f"{rot} rotated channels of {t.shape[-1]} (an even number, at most all)"
    if signed_sin.shape != cos.shape or signed_sin.stride() != cos.stride():
        return "the sine table does not lie as the cosine table does"
    dtypes = {t.dtype, cos.dtype, signed_sin.dtype}
    if len(dtypes) > 1 or t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"{t.dtype} with {cos.dtype} / {signed_sin.dtype} tables"
    if not t.is_cuda:
        return "not on CUDA"
    if _kernel() is None:
        return "Triton is not installed"
    return None


def _rope_kernel(t, cos, signed_sin, backward: bool) -> torch.Tensor:
    kernel, cdiv, next_power_of_2 = _kernel()
    seq, batch, heads, dim = t.shape
    out = torch.empty((seq, batch, heads, dim), dtype=t.dtype, device=t.device)
    block_d = next_power_of_2(dim)
    block_h = max(1, min(next_power_of_2(heads), 4096 // block_d))
    table_b = cos.stride(1) if cos.shape[1] > 1 else 0
    if out.numel():
        kernel[(seq * batch, cdiv(heads, block_h))](
            t, cos, signed_sin, out, batch, heads, dim, cos.shape[-1],
            t.stride(0), t.stride(1), t.stride(2), cos.stride(0), table_b,
            BACKWARD=backward, BLOCK_H=block_h, BLOCK_D=block_d,
        )  # fmt: skip
    return out


class _RopeKernel(torch.autograd.Function):
    """:class:`_Rope` of the whole head dimension (the unrotated rest copied) in one Triton
    kernel each way, in float32, rounded once."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        ctx.save_for_backward(cos, signed_sin)
        return _rope_kernel(t, cos, signed_sin, backward=False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, signed_sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _rope_kernel(grad, cos, signed_sin, backward=True), None, None


def _rotate(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    if rope_kernel_reason(t, cos, signed_sin) is None:
        return _RopeKernel.apply(t, cos, signed_sin)
    rot = cos.shape[-1]
    if rot == t.shape[-1]:
        return _Rope.apply(t, cos, signed_sin)
    return torch.cat((_Rope.apply(t[..., :rot], cos, signed_sin), t[..., rot:]), dim=-1)


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """megatron's non-interleaved RoPE of ``t`` ``[s, b, heads, dim]`` with ``freqs``
    ``[s, 1 | b, 1, rot]``: the first ``rot`` channels rotated, the rest passed through."""
    return _rotate(t, *rope_tables(freqs, t.dtype, mscale))


def thd_positions(cu_seqlens: torch.Tensor, tokens: int, restart: bool = True) -> torch.Tensor:
    """The RoPE position of each of ``tokens`` packed tokens, on ``cu_seqlens``' device without
    a host read: its index in its sequence (``restart``), or in the packed row.

    Args:
        cu_seqlens: ``[sequences + 1]`` offsets of the sequences in the row (padded offsets where
            the sequences are padded apart: the padding continues its sequence's positions).
        tokens: the row's length (megatron requires the offsets to end there).
        restart: positions restart at 0 in every sequence.
    """
    entries = per_tensor(_THD, cu_seqlens)
    key = ("positions", tokens, restart, cu_seqlens._version)
    if key not in entries:
        entries[key] = _positions(cu_seqlens, tokens, restart)
    return entries[key]


def _positions(cu_seqlens: torch.Tensor, tokens: int, restart: bool) -> torch.Tensor:
    index = torch.arange(tokens, device=cu_seqlens.device)
    if restart:
        offsets = cu_seqlens.to(torch.int64)
        # The sequence of each token (trailing empty segments, as fixed-size boundaries have,
        # start at the row's length: they hold none); tokens past the last boundary stay in the
        # last sequence.
        sequence = row_segments(offsets, index).clamp_(max=offsets.numel() - 2)
        index = index - offsets[sequence]
    return index


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def apply_rope_thd(
    t: torch.Tensor,
    freqs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mscale: float = 1.0,
    restart: bool | None = None,
) -> torch.Tensor:
    """megatron's non-interleaved RoPE of a packed row ``t`` (``[tokens, heads, dim]`` or
    ``[tokens, 1, heads, dim]``), with ``freqs`` ``[max positions, 1, 1, rot]`` and the
    sequences' offsets ``cu_seqlens``, as ``_apply_rotary_pos_emb_thd`` without context
    parallelism computes it (see the module doc).

    ``restart``: positions restart in every sequence; None decides as megatron does, by the
    table's length (fixed-size boundaries pass True: their table is sized by the row, and
    megatron's MLA cuts it to the row's length)."""
    tokens = t.shape[0]
    if restart is None:
        restart = freqs.shape[0] != tokens  # megatron's exact mapping: one frequency per token
    if _capturing(t):  # a replay computes them from the graph's inputs (see rope_tables)
        positions = _positions(cu_seqlens, tokens, restart)
        cos, signed_sin = rope_tables(freqs, t.dtype, mscale)
        rows = (cos.index_select(0, positions), signed_sin.index_select(0, positions))
        return _rotate_rows(t, *rows)
    entries = per_tensor(_THD, cu_seqlens)
    key = ("tables", id(freqs), freqs._version, cu_seqlens._version, t.dtype, float(mscale),
           tokens, restart)  # fmt: skip
    found = entries.get(key)
    if found is None or found[0]() is not freqs:
        positions = thd_positions(cu_seqlens, tokens, restart)
        cos, signed_sin = rope_tables(freqs, t.dtype, mscale)
        found = (weakref.ref(freqs), cos.index_select(0, positions),
                 signed_sin.index_select(0, positions))  # fmt: skip
        entries[key] = found
    return _rotate_rows(t, found[1], found[2])


def _rotate_rows(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    if t.dim() == 3:
        return _rotate(t.unsqueeze(1), cos, signed_sin).squeeze(1)
    return _rotate(t, cos, signed_sin)

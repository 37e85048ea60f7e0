"""GatedDeltaNet's ``dq``, ``dk``, ``dw`` and ``dg`` in one Triton kernel that Triton 3.4-3.7.0
compiles correctly on Hopper.

fla 0.6.0's backward (``chunk_gated_delta_rule_bwd``) computes these four gradients per chunk in
``ops/common/chunk_o.py``, ``chunk_bwd_kernel_dqkwg``, and refuses to run it on Hopper with
Triton >= 3.4.0, < 3.7.1 (fla issue #640, wrong ``dk``, hence ``dg`` and ``dbeta``). The cause
(fla pull request #826): the kernel transposes its ``ds = do v^T`` accumulator, which lives in
the tensor cores' output register layout (``tl.trans`` gives a ``#linear`` layout), and feeds it
to another dot (``dk += ds^T q``); those Triton versions emit wrong code for that on sm_90.
:func:`chunk_bwd_dqkwg` computes the same gradients (the same inputs, outputs and layouts, so
fla's backward can dispatch to it: :mod:`~megatron_hybrid.modules.fla_backend`) without
transposing an accumulator: it accumulates ``ds^T = v do^T`` with a dot of its own from the
loaded tiles (one more ``BT x BT x BV`` product per value block, about 15 % more arithmetic in
this kernel at ``K = V = 128``), and masks and scales it as the transpose of ``ds``.

Per chunk of ``BT`` steps and block of ``BK`` key channels (``g`` the chunk-local cumulative log2
decay, ``scale`` the query scale, ``h`` / ``dh`` the state entering the chunk and its gradient,
``ds = do v^T`` and ``D[i, j] = 2^(g_i - g_j) scale`` for ``i >= j``, else 0)::

    dq = (do h^T) * 2^g * scale + (ds o D) k
    dk = (v dh^T) * 2^(g_last - g) + (ds o D)^T q
    dw = -(dv h^T)
    dg = rowsum(dq o q) - rowsum(dk o k),  the last step + 2^g_last sum(h o dh) + sum(dk o k)

(``dg`` summed over the key blocks afterwards; fla's backward takes the reverse cumulative sum.)
"""

from __future__ import annotations

import functools

import torch

__all__ = ["chunk_bwd_dqkwg"]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.autotune(
        configs=[
            triton.Config({}, num_warps=warps, num_stages=stages)
            for warps in (4, 8)
            for stages in (2, 3)
        ],
        key=["H", "HV", "K", "V", "BT", "BK", "BV", "USE_DW", "STATE_V_FIRST"],
    )
    @triton.jit(do_not_specialize=["T"])
    def dqkwg_kernel(  # Triton's names: sizes and switches in capitals, as fla's kernels
        q, k, v, g, h, do, dh, dq, dk, dw, dv, dg, cu_seqlens, chunk_indices, scale,
        B: tl.constexpr, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,  # noqa: N803
        V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,  # noqa: N803
        USE_DW: tl.constexpr, STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        i_k = tl.program_id(0).to(tl.int64) % tl.cdiv(K, BK)
        i_t = tl.program_id(0).to(tl.int64) // tl.cdiv(K, BK)
        i_bh = tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // HV, i_bh % HV
        if IS_VARLEN:
            chunk = i_t  # chunks are numbered across the packed sequences
            i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
            i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
            bos = tl.load(cu_seqlens + i_n).to(tl.int64)
            eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
            length = eos - bos
        else:
            length = T.to(tl.int64)
            chunk = i_b * tl.cdiv(length, BT) + i_t
            bos = i_b * length
        all_tokens = (B * T).to(tl.int64)
        i_hk = i_h // (HV // H)  # the key head this value head reads

        rows = i_t * BT + tl.arange(0, BT)  # steps of this chunk within its sequence
        row_ok = rows < length
        cols_k = i_k * BK + tl.arange(0, BK)
        k_ok = cols_k < K
        state = (chunk * HV + i_h) * K * V

        acc_dq = tl.zeros([BT, BK], dtype=tl.float32)
        acc_dk = tl.zeros([BT, BK], dtype=tl.float32)
        acc_dw = tl.zeros([BT, BK], dtype=tl.float32)
        acc_ds = tl.zeros([BT, BT], dtype=tl.float32)  # do v^T
        acc_dst = tl.zeros([BT, BT], dtype=tl.float32)  # v do^T, not a transposed accumulator
        dg_last = tl.zeros([1], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            cols_v = i_v * BV + tl.arange(0, BV)
            v_ok = cols_v < V
            tile = (bos + rows[:, None]) * (HV * V) + i_h * V + cols_v[None, :]
            tile_ok = row_ok[:, None] & v_ok[None, :]
            b_v = tl.load(v + tile, mask=tile_ok, other=0.0)
            b_do = tl.load(do + tile, mask=tile_ok, other=0.0)
            if STATE_V_FIRST:  # state [V, K]
                at = state + cols_v[:, None] * K + cols_k[None, :]
            else:  # state [K, V], read as [BV, BK]
                at = state + cols_k[None, :] * V + cols_v[:, None]
            state_ok = v_ok[:, None] & k_ok[None, :]
            b_h = tl.load(h + at, mask=state_ok, other=0.0)
            b_dh = tl.load(dh + at, mask=state_ok, other=0.0)
            dg_last += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32))
            acc_ds = tl.dot(b_do, tl.trans(b_v), acc_ds)
            acc_dst = tl.dot(b_v, tl.trans(b_do), acc_dst)
            acc_dq = tl.dot(b_do, b_h.to(b_do.dtype), acc_dq)
            acc_dk = tl.dot(b_v, b_dh.to(b_v.dtype), acc_dk)
            if USE_DW:
                b_dv = tl.load(dv + tile, mask=tile_ok, other=0.0)
                acc_dw = tl.dot(b_dv.to(b_v.dtype), b_h.to(b_v.dtype), acc_dw)

        out_k = (bos + rows[:, None]) * (HV * K) + i_h * K + cols_k[None, :]
        out_ok = row_ok[:, None] & k_ok[None, :]
        if USE_DW:
            tl.store(dw + out_k, (-acc_dw).to(dw.dtype.element_ty), mask=out_ok)

        in_k = (bos + rows[:, None]) * (H * K) + i_hk * K + cols_k[None, :]
        b_q = tl.load(q + in_k, mask=out_ok, other=0.0)
        b_k = tl.load(k + in_k, mask=out_ok, other=0.0)
        b_g = tl.load(g + (bos + rows) * HV + i_h, mask=row_ok, other=0.0).to(tl.float32)
        last = tl.minimum(i_t * BT + BT, length) - 1
        g_last = tl.load(g + (bos + last) * HV + i_h).to(tl.float32)

        dg_last *= tl.math.exp2(g_last)
        acc_dq = acc_dq * tl.math.exp2(b_g)[:, None] * scale
        acc_dk = acc_dk * tl.where(row_ok, tl.math.exp2(g_last - b_g), 0.0)[:, None]
        dg_last += tl.sum(acc_dk * b_k.to(tl.float32))
        # ds[i, j] for j <= i; its transpose dst[j, i] is masked and scaled alike.
        lower = (rows[:, None] >= rows[None, :]) & row_ok[:, None] & row_ok[None, :]
        upper = (rows[:, None] <= rows[None, :]) & row_ok[:, None] & row_ok[None, :]
        decay = b_g[:, None] - b_g[None, :]
        b_ds = tl.where(lower, acc_ds * tl.math.exp2(decay), 0.0) * scale
        b_dst = tl.where(upper, acc_dst * tl.math.exp2(-decay), 0.0) * scale
        acc_dq = tl.dot(b_ds.to(b_k.dtype), b_k, acc_dq)
        acc_dk = tl.dot(b_dst.to(b_q.dtype), b_q, acc_dk)
        b_dg = tl.sum(acc_dq * b_q.to(tl.float32), axis=1) - tl.sum(acc_dk * b_k.to(tl.float32), 1)
        b_dg = tl.where(rows == last, b_dg + dg_last, b_dg)
        tl.store(dq + out_k, acc_dq.to(dq.dtype.element_ty), mask=out_ok)
        tl.store(dk + out_k, acc_dk.to(dk.dtype.element_ty), mask=out_ok)
        at_g = i_k * all_tokens * HV + (bos + rows) * HV + i_h
        tl.store(dg + at_g, b_dg, mask=row_ok)

    return dqkwg_kernel, triton


def chunk_bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
):
    """fla 0.6.0's ``chunk_bwd_dqkwg`` (``ops/common/chunk_o.py``) for a gated rule (``g``
    given, no ``g_gamma``): ``(dq, dk, dw, dg)`` in its layouts. See the module doc.

    Raises:
        ValueError: no ``g``, or a ``g_gamma`` (those cases have no #640 problem: fla's own
            kernel serves them).
    """
    if g is None or g_gamma is not None:
        raise ValueError("chunk_bwd_dqkwg here computes the gated rule only (g, no g_gamma)")
    kernel, triton = _kernel()
    batch, tokens, heads, key_dim = k.shape
    value_dim, value_heads = v.shape[-1], v.shape[2]
    if cu_seqlens is not None and chunk_indices is None:
        from fla.ops.utils import prepare_chunk_indices  # lazy: fla, present with this path

        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    chunks = triton.cdiv(tokens, chunk_size) if cu_seqlens is None else len(chunk_indices)
    block_k = min(max(triton.next_power_of_2(key_dim), 16), 128)
    block_v = min(max(triton.next_power_of_2(value_dim), 16), 64)
    key_blocks = triton.cdiv(key_dim, block_k)
    scale = key_dim**-0.5 if scale is None else scale
    dq = q.new_empty(batch, tokens, value_heads, key_dim)
    dk = k.new_empty(batch, tokens, value_heads, key_dim)
    dw = torch.empty_like(w) if w is not None else None
    dg = torch.empty(key_blocks, *g.shape, dtype=torch.float32, device=g.device)
    grid = (key_blocks * chunks, batch * value_heads)
    kernel[grid](
        q, k, v, g, h, do, dh, dq, dk, dw, dv, dg, cu_seqlens, chunk_indices, scale,
        B=batch, T=tokens, H=heads, HV=value_heads, K=key_dim, V=value_dim, BT=chunk_size,
        BK=block_k, BV=block_v, USE_DW=w is not None, STATE_V_FIRST=state_v_first,
        IS_VARLEN=cu_seqlens is not None,
    )  # fmt: skip
    if heads != value_heads:
        group = value_heads // heads
        dq = dq.view(batch, tokens, heads, group, key_dim).sum(3)
        dk = dk.view(batch, tokens, heads, group, key_dim).sum(3)
    return dq, dk, dw, dg.sum(0)

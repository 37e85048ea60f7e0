"""fla's gated ``chunk_bwd_dqkwg`` in float64 torch, and the float32 rounding bound of a kernel.

The oracle of :mod:`megatron_hybrid.modules.fla_dqkwg` (and of fla's own kernel, which computes
the same): per sequence, chunk of ``chunk_size`` steps and value head, from the module doc's
formulas, with plain loops and no blocking. :func:`dqkwg_magnitudes` runs the same formulas on
absolute values: a float32 kernel that sums products in any order (and evaluates ``2^x`` to a
few ulps) is off from the float64 values by at most ``gamma_n`` times these magnitudes (Higham,
*Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1: a sum of ``n`` products
computed in floating point is off by at most ``gamma_n`` times the sum of their absolute
values), with ``n`` the longest chain of roundings any output takes (:func:`dqkwg_bound`).
"""

from __future__ import annotations

import torch

__all__ = ["dqkwg_bound", "dqkwg_magnitudes", "dqkwg_reference"]


def _sequences(batch: int, tokens: int, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, tokens) for b in range(batch)]
    offsets = [int(x) for x in cu_seqlens]
    return [(0, start, end) for start, end in zip(offsets[:-1], offsets[1:], strict=True)]


def dqkwg_reference(
    q, k, v, do, h, dh, w=None, g=None, dv=None, scale=None, state_v_first=False,
    cu_seqlens=None, chunk_size=64, absolute=False,
):  # fmt: skip
    """``(dq, dk, dw, dg)`` of fla's gated ``chunk_bwd_dqkwg`` in float64 (``dq``, ``dk`` summed
    over the value heads of a key head; ``dw`` None without ``w``). ``absolute``: every input by
    its absolute value and every difference a sum (the magnitudes of
    :func:`dqkwg_magnitudes`)."""
    f = (lambda x: x.double().abs()) if absolute else (lambda x: x.double())
    q, k, v, do = (f(x) for x in (q, k, v, do))
    g = g.double()  # the decay factors 2^(.) are positive: their magnitudes are themselves
    batch, tokens, heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[-1]
    shape = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    h = f(h).reshape(-1, value_heads, *shape)
    dh = f(dh).reshape(-1, value_heads, *shape)
    if state_v_first:
        h, dh = h.transpose(-1, -2), dh.transpose(-1, -2)
    dv = None if dv is None else f(dv)
    scale = key_dim**-0.5 if scale is None else scale
    dq = torch.zeros(batch, tokens, value_heads, key_dim, dtype=torch.float64)
    dk, dw = torch.zeros_like(dq), (torch.zeros_like(dq) if w is not None else None)
    dg = torch.zeros(batch, tokens, value_heads, dtype=torch.float64)
    chunk = 0
    for b, start, end in _sequences(batch, tokens, cu_seqlens):
        for first in range(start, end, chunk_size):
            rows = slice(first, min(first + chunk_size, end))
            for hv in range(value_heads):
                hk = hv // (value_heads // heads)
                state, dstate = h[chunk, hv], dh[chunk, hv]  # [K, V]
                q_c, k_c = q[b, rows, hk], k[b, rows, hk]
                v_c, do_c, g_c = v[b, rows, hv], do[b, rows, hv], g[b, rows, hv]
                n = g_c.shape[0]
                sign = -1 if absolute else 1
                causal = torch.ones(n, n, dtype=torch.bool).tril()
                decay = torch.where(causal, torch.exp2(g_c[:, None] - g_c[None, :]), 0.0) * scale
                ds = (do_c @ v_c.T) * decay
                inter_k = (v_c @ dstate.T) * torch.exp2(g_c[-1] - g_c)[:, None]
                dq_c = (do_c @ state.T) * torch.exp2(g_c)[:, None] * scale + ds @ k_c
                dk_c = inter_k + ds.T @ q_c
                if dw is not None:
                    dw[b, rows, hv] = sign * -(dv[b, rows, hv] @ state.T)
                dg_c = (dq_c * q_c).sum(1) + sign * -(dk_c * k_c).sum(1)
                dg_c[-1] += torch.exp2(g_c[-1]) * (state * dstate).sum() + (inter_k * k_c).sum()
                dq[b, rows, hv], dk[b, rows, hv], dg[b, rows, hv] = dq_c, dk_c, dg_c
            chunk += 1
    if heads != value_heads:
        group = value_heads // heads
        dq = dq.view(batch, tokens, heads, group, key_dim).sum(3)
        dk = dk.view(batch, tokens, heads, group, key_dim).sum(3)
    return dq, dk, dw, dg


def dqkwg_magnitudes(*args, **kwargs):
    """:func:`dqkwg_reference` of the absolute values: what float32 errors are relative to."""
    return dqkwg_reference(*args, absolute=True, **kwargs)


def dqkwg_bound(key_dim: int, value_dim: int, chunk_size: int, magnitudes):
    """Per output, ``gamma_n`` times its magnitude, ``n`` counting every rounding an output
    accumulates: the value and key sums, the chunk's causal sum, the state's ``K V`` sum of
    ``dg``'s last step, the exponentials (4 ulps each), scalings and the cast to the output."""
    u = 2.0**-24
    n = key_dim * value_dim + value_dim + key_dim + chunk_size + 16
    gamma = n * u / (1 - n * u)
    return [None if m is None else gamma * m for m in magnitudes]

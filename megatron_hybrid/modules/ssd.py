"""Mamba2's three sequence operations in plain torch: causal conv, chunked SSD scan, gated norm.

These compute the functions that megatron-core's ``MambaMixer`` gets from mamba_ssm's kernels
(``mamba_split_conv1d_scan_combined`` followed by ``RMSNormGated``, mamba_ssm 2.x), with
autograd providing the backward pass, so they run wherever torch runs (CPU, or a GPU without
mamba_ssm). Per batch row and head ``h`` (group ``g(h)``), Mamba2's state ``S`` (``[P, N]``)
evolves, from ``S = 0``, as::

    dt_t = softplus(dt_raw_t + dt_bias)                 # step size, float32
    S    <- exp(dt_t * A) * S + dt_t * x_t B_t^T        # A < 0: a per-head decay
    y_t  = S C_t + D * x_t                              # D: skip connection

:func:`ssd_chunk_scan` evaluates this blockwise (the "state space duality" form): inside a
chunk of ``chunk_size`` steps the output is a masked, decay-weighted ``C B^T`` product (a small
attention), and only chunk-final states are passed from chunk to chunk. Arithmetic is float32
whatever the input dtype, as in the kernels. :func:`mamba2_scan` puts the conv and the scan
together as the mixer computes them between its projections.
"""

from __future__ import annotations

import math

import torch
from torch.nn.functional import conv1d, pad, silu

from megatron_hybrid.kernels.tf32 import contract

__all__ = ["causal_conv1d", "gated_rms_norm", "mamba2_scan", "ssd_chunk_scan"]


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution over time followed by SiLU, computed in float32.

    Args:
        x: ``[B, T, D]``.
        weight: ``[D, W]``: output step ``t`` sees inputs ``t - W + 1 .. t``.
        bias: ``[D]`` or None.
        seq_idx: optional ``[B, T]`` sequence ids of packed rows (non-decreasing along ``T``):
            a step sees no input of another sequence, as with causal_conv1d's ``seq_idx``.

    Returns:
        ``[B, T, D]`` in ``x``'s dtype.
    """
    width = weight.shape[-1]
    xf, wf = x.float(), weight.float()
    bf = bias.float() if bias is not None else None
    if seq_idx is None:
        padded = pad(xf.transpose(1, 2), (width - 1, 0))  # left only: step t sees t-W+1..t
        y = conv1d(padded, wf.unsqueeze(1), bf, groups=wf.shape[0])
        return silu(y).transpose(1, 2).to(x.dtype)
    # Shifted sums, so that taps reaching into a previous sequence can be masked out.
    y = torch.zeros_like(xf) if bf is None else bf.expand_as(xf).clone()
    for tap in range(width):
        shift = width - 1 - tap
        if shift >= x.shape[1]:
            continue
        src = pad(xf, (0, 0, shift, 0))[:, : x.shape[1]]
        same = seq_idx == pad(seq_idx, (shift, 0), value=-1)[:, : x.shape[1]]
        y = y + src * wf[:, tap] * same.unsqueeze(-1)
    return silu(y).to(x.dtype)


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``j <= i``, else ``-inf``.

    Summed from masked copies rather than as a difference of cumulative sums, which would lose
    precision when the totals are large.
    """
    size = a.shape[-1]
    below = torch.ones(size, size, dtype=torch.bool, device=a.device).tril(-1)
    sums = a.unsqueeze(-1).expand(*a.shape, size).masked_fill(~below, 0).cumsum(dim=-2)
    on_or_below = below.logical_or(torch.eye(size, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~on_or_below, -torch.inf)


def _chunks(t: torch.Tensor, extra: int, chunk_size: int) -> torch.Tensor:
    """``[B, T, ...]`` zero-padded to ``T + extra`` and cut into ``[B, C, chunk_size, ...]``."""
    padded = pad(t, (0, 0) * (t.dim() - 2) + (0, extra))
    return padded.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    chunk_size: int,
    d: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    tf32: bool = False,
) -> torch.Tensor:
    """Mamba2's selective scan in chunks of ``chunk_size`` steps, in float32.

    Args:
        x: ``[B, T, H, P]``.
        dt: ``[B, T, H]`` step sizes, already through ``softplus(dt + dt_bias)``.
        a: ``A``, ``[H]``, negative.
        b: ``B``, ``[B, T, G, N]``; head ``h`` reads group ``h // (H // G)``.
        c: ``C``, ``[B, T, G, N]``.
        chunk_size: steps per chunk; need not divide ``T`` (the last chunk is zero-padded).
        d: ``D``, skip weights ``[H]`` or ``[H, P]``, or None.
        seq_idx: optional ``[B, T]`` non-decreasing sequence ids: the state restarts from zero
            where the id changes (packed sequences).
        tf32: the products of the scan (``C B^T``, the chunk states and outputs) on TF32 on
            CUDA (:func:`~megatron_hybrid.kernels.tf32.tf32_bmm`; the fast path's choice);
            everything else stays float32.

    Returns:
        ``y`` ``[B, T, H, P]``, float32.
    """
    batch, seq, heads, head_dim = x.shape
    groups = b.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} heads cannot be split into {groups} groups of B and C")
    per_group = heads // groups
    extra = (-seq) % chunk_size  # zero steps after the end: they change no earlier output
    xf = x.float()
    dtf = dt.float()

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [..., H, *] -> [..., G, H/G, *]
        return t.unflatten(2 if t.dim() > 2 else -1, (groups, per_group))

    # b batch, c chunk, l/s step in chunk (target/source), g group, r head in group,
    # p head dim, n state dim, z/y chunk boundaries (target/source).
    xdt = _chunks(grouped(xf * dtf.unsqueeze(-1)), extra, chunk_size)  # b c l g r p
    bc = _chunks(b.float(), extra, chunk_size)  # b c l g n
    cc = _chunks(c.float(), extra, chunk_size)
    log_decay = _chunks(grouped(dtf * a.float()), extra, chunk_size).permute(0, 3, 4, 1, 2)
    cum = log_decay.cumsum(dim=-1)  # b g r c l

    decay_in_chunk = torch.exp(_segment_sums(log_decay))  # b g r c l s
    decay_to_end = torch.exp(cum[..., -1:] - cum)  # b g r c s
    decay_from_start = torch.exp(cum)  # b g r c l
    chunk_ends = pad(cum[..., -1], (1, 0))  # b g r (c+1): log decay of every whole chunk
    decay_between = torch.exp(_segment_sums(chunk_ends))  # b g r z y
    if seq_idx is not None:
        # Padded steps get id -1; they come after every real step, so nothing real reads them.
        ids = pad(seq_idx, (0, extra), value=-1).reshape(batch, -1, chunk_size)  # b c l
        end_ids = ids[:, :, -1]
        boundary_ids = pad(end_ids, (1, 0), value=-2)  # state after chunk y-1; y=0: initial

        def same(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # broadcast over g, r
            return (u == v)[:, None, None].float()

        decay_in_chunk = decay_in_chunk * same(ids[..., :, None], ids[..., None, :])
        decay_to_end = decay_to_end * same(ids, end_ids[..., None])
        decay_from_start = decay_from_start * same(ids, boundary_ids[:, :-1, None])
        decay_between = decay_between * same(boundary_ids[:, :, None], boundary_ids[:, None, :])

    # 1. Within chunks: y_l = sum_{s <= l} (C_l . B_s) decay(s -> l) dt_s x_s.
    scores = contract("bclgn,bcsgn->bgcls", cc, bc, tf32=tf32)
    weights = scores.unsqueeze(2) * decay_in_chunk  # b g r c l s
    y = contract("bgrcls,bcsgrp->bclgrp", weights, xdt, tf32=tf32)
    # 2. Each chunk's own contribution to the state at its end.
    to_end = decay_to_end.permute(0, 3, 4, 1, 2).unsqueeze(-1)  # b c s g r 1
    states = contract("bcsgn,bcsgrp->bcgrpn", bc, xdt * to_end, tf32=tf32)
    # 3. States at chunk starts: decayed sums over all earlier chunks (zero initial state).
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    states = contract("bgrzy,bygrpn->bzgrpn", decay_between, states, tf32=tf32)[:, :-1]
    # 4. What the carried-in state adds to every step of the chunk.
    from_start = decay_from_start.permute(0, 3, 4, 1, 2).unsqueeze(-1)  # b c l g r 1
    y = y + contract("bclgn,bcgrpn->bclgrp", cc, states, tf32=tf32) * from_start

    y = y.reshape(batch, seq + extra, heads, head_dim)[:, :seq]
    if d is not None:
        skip = d.float() if d.dim() == 2 else d.float().unsqueeze(-1)
        y = y + skip * xf
    return y


def gated_rms_norm(
    y: torch.Tensor,
    z: torch.Tensor | None,
    weight: torch.Tensor | None,
    group_size: int,
    eps: float,
) -> torch.Tensor:
    """``rmsnorm(y * silu(z)) * weight`` with the RMS taken over groups of ``group_size`` channels.

    mamba_ssm's ``RMSNormGated`` with ``norm_before_gate=False``: the gate multiplies first; each
    group of channels (megatron-core: ``d_inner_local / ngroups_local``) is normalised on its
    own, so a TP shard normalises exactly the groups it holds. Computed in float32.

    Args:
        y: ``[..., D]``.
        z: gate ``[..., D]`` or None (no gate).
        weight: ``[D]`` or None (no scale).
        group_size: channels per group; must divide ``D``.
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``y``'s dtype.
    """
    if y.shape[-1] % group_size:
        raise ValueError(f"group size {group_size} does not divide {y.shape[-1]} channels")
    out = y.float()
    if z is not None:
        out = out * silu(z.float())
    grouped = out.unflatten(-1, (-1, group_size))
    grouped = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)
    out = grouped.flatten(-2)
    if weight is not None:
        out = out * weight.float()
    return out.to(y.dtype)


def mamba2_scan(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    d: torch.Tensor,
    seq_idx: torch.Tensor | None = None,
    *,
    heads: int,
    groups: int,
    state: int,
    head_dim: int,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    d_has_hdim: bool = False,
    tf32: bool = False,
) -> torch.Tensor:
    """Mamba2's mixer between its projections: ``[B, L, z|x|B|C|dt]`` -> ``[B, L, d_inner]``.

    What ``mamba_split_conv1d_scan_combined`` computes without its norm: conv + SiLU on
    ``x|B|C``, the scan with ``dt = softplus(dt + dt_bias)`` and the ``D`` skip (per head, or
    per channel with ``d_has_hdim``), then the gate ``y * silu(z)``
    (mamba_ssm 2.x, ``ssd_combined.py``); rounded to the input dtype like the kernel's output.
    ``tf32`` is :func:`ssd_chunk_scan`'s. A pure function of its arguments, so it can be
    compiled as one piece.
    """
    d_inner = heads * head_dim
    z, xbc, dt = torch.split(zxbcdt, [d_inner, d_inner + 2 * groups * state, heads], -1)
    xbc = causal_conv1d(xbc, conv_weight, conv_bias, seq_idx)
    x, b, c = torch.split(xbc, [d_inner, groups * state, groups * state], -1)
    dt = torch.nn.functional.softplus(dt.float() + dt_bias.float())
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    y = ssd_chunk_scan(
        x.unflatten(-1, (heads, head_dim)),
        dt,
        -torch.exp(a_log.float()),
        b.unflatten(-1, (groups, state)),
        c.unflatten(-1, (groups, state)),
        chunk_size,
        d=d.unflatten(0, (heads, head_dim)) if d_has_hdim else d,
        seq_idx=seq_idx,
        tf32=tf32,
    ).flatten(-2)
    return (y * torch.nn.functional.silu(z.float())).to(zxbcdt.dtype)

"""One pass over a vocabulary shard's logits per row: the softmax statistics as a Triton kernel;
and one more for the softmax's gradient (:func:`softmax_gradient`).

:func:`~megatron_hybrid.logprobs.vocab.token_logprobs` needs, per row of logits, the maximum of
``x / T``, ``S = sum exp(z)`` and (for the entropy) ``sum exp(z) z`` with ``z = x / T - max``. The
torch reference (``vocab._softmax_statistics_blocks``) reads the logits in float32 blocks of
rows, twice (the maximum, then the sums) with a handful of kernels per block: for a vocabulary of
248,320 that is about ten kernels per 67 rows, over a thousand launches and 3-4 passes over the
logits per micro-batch of 16k tokens. :func:`row_statistics` reads each row once, in its own
dtype, with an online maximum (as FlashAttention's softmax rescales its running sum when the
maximum grows):

* ``m' = max(m, max_j z_j)``; ``S' = S e^{m - m'} + sum_j e^{z_j - m'}``;
* ``U = sum e^{z - m} (z - m)`` rescales as ``U' = e^{m - m'} (U + (m - m') S) + sum_j
  e^{z_j - m'} (z_j - m')``, since ``z - m' = (z - m) + (m - m')``.

The statistics are local to this rank's shard; :func:`combine_shards` turns every rank's ``(m, S,
U)`` into the global ones with the same rescaling (one MAX and one SUM all-reduce, as the torch
path needs; the SUM carries the caller's other per-row sums too). Accumulation is float32, as in
the reference; the two differ by the order of float32 additions only. The model's cross entropy
(:mod:`~megatron_hybrid.kernels.cross_entropy`) takes ``(m, S)`` from the same pass.

:func:`softmax_gradient` is the backward pass of both: ``(g_lp ([j = t] - p_j) - g_h p_j (log p_j
+ H)) / T`` per column, ``p_j = exp(x_j / T - m) / S`` from the saved statistics, in float32 and
rounded once; padding columns get 0. It replaces the torch blocks' half a dozen kernels and
float32 temporaries per block of rows.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from megatron_hybrid.triton_lazy import lazy_triton

__all__ = [
    "Combined",
    "combine_shards",
    "kernel_reason",
    "row_statistics",
    "softmax_gradient",
]

#: Columns of a row per loop iteration of the kernel.
_BLOCK = 4096


@lazy_triton
def _kernel(triton, tl):
    """The Triton kernel, or None where Triton cannot be imported."""

    @triton.jit
    def row_statistics_kernel(
        logits_ptr, row_stride, valid, inv_temperature,  # noqa: N803
        max_ptr, sum_ptr, zsum_ptr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        columns = tl.arange(0, BLOCK)
        # Per-lane running statistics, merged across lanes at the end: one rescale per lane
        # and block instead of a reduction of the whole block per step.
        m = tl.full((BLOCK,), -float("inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        u = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, valid, BLOCK):
            index = start + columns
            x = tl.load(base + index, mask=index < valid, other=-float("inf")).to(tl.float32)
            z = x * inv_temperature
            new_m = tl.maximum(m, z, propagate_nan=tl.PropagateNan.ALL)
            # Lanes that have seen nothing yet keep -inf: exp(-inf - -inf) would be NaN; a
            # column past the shard (or a logit of -inf) adds exp(-inf) = 0 to S and nothing
            # (not 0 * -inf) to U.
            alpha = tl.where(new_m == -float("inf"), 0.0, tl.exp(m - new_m))
            live = z != -float("inf")
            shifted = tl.where(live, z - new_m, 0.0)
            e = tl.where(live, tl.exp(shifted), 0.0)
            if ENTROPY:
                delta = tl.where(m == -float("inf"), 0.0, m - new_m)
                u = alpha * (u + delta * s) + e * shifted
            s = alpha * s + e
            m = new_m
        row_max = tl.max(m, axis=0)
        scale = tl.where(m == -float("inf"), 0.0, tl.exp(m - row_max))
        total = tl.sum(s * scale, axis=0)
        tl.store(max_ptr + row, row_max)
        tl.store(sum_ptr + row, total)
        if ENTROPY:
            delta = tl.where(m == -float("inf"), 0.0, m - row_max)
            tl.store(zsum_ptr + row, tl.sum(scale * (u + delta * s), axis=0))

    return row_statistics_kernel


@lazy_triton
def _gradient_kernel(triton, tl):
    """The Triton kernel of :func:`softmax_gradient`, or None where Triton cannot be imported."""

    @triton.jit
    def softmax_gradient_kernel(
        logits_ptr, row_stride, out_ptr, columns, valid, inv_temperature,  # noqa: N803
        target_ptr, shift_ptr, sum_ptr, g_target_ptr, g_entropy_ptr, entropy_ptr,  # noqa: N803
        ENTROPY: tl.constexpr, BLOCK: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        real = index < valid
        x = tl.load(logits_ptr + row * row_stride + index, mask=real, other=0.0).to(tl.float32)
        z = x * inv_temperature - tl.load(shift_ptr + row)
        total = tl.load(sum_ptr + row)
        p = tl.exp(z) / total
        # The target's column (-1: none of this shard's) gains g_target; every column loses
        # g_target p.
        hit = index == tl.load(target_ptr + row)
        grad = tl.load(g_target_ptr + row) * (tl.where(hit, 1.0, 0.0) - p)
        if ENTROPY:  # dH/dz_j = -p_j (log p_j + H)
            log_p = z - tl.log(total)
            grad -= tl.load(g_entropy_ptr + row) * p * (log_p + tl.load(entropy_ptr + row))
        grad = tl.where(real, grad * inv_temperature, 0.0)  # padding columns: no gradient
        out = out_ptr + row * columns + index
        tl.store(out, grad.to(out_ptr.dtype.element_ty), mask=index < columns)

    return softmax_gradient_kernel


def kernel_reason(flat: Tensor) -> str | None:
    """Why :func:`row_statistics` cannot take ``flat`` (``[rows, columns]``), or None."""
    # Triton's CPU interpreter (TRITON_INTERPRET=1, as the tests run it) takes host tensors.
    if not flat.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "logits not on a CUDA device (the torch blocks run)"
    if flat.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"logits in {flat.dtype}"
    if flat.dim() != 2 or flat.stride(-1) != 1:
        return "logits whose vocabulary dimension is not contiguous"
    if _kernel() is None or _gradient_kernel() is None:
        return "Triton is not importable"
    return None


def row_statistics(flat: Tensor, valid: int, temperature: float, entropy: bool):
    """Per row of ``flat[:, :valid]``: ``(m, S, U)`` in float32, with ``m`` the maximum of
    ``x / T``, ``S = sum exp(x / T - m)`` and (``entropy``; else None) ``U = sum exp(x / T - m)
    (x / T - m)``. Rows without a column get ``(-inf, 0, 0)``."""
    rows = flat.size(0)
    device = flat.device
    m = torch.full((rows,), -math.inf, dtype=torch.float32, device=device)
    s = torch.zeros(rows, dtype=torch.float32, device=device)
    u = torch.zeros(rows, dtype=torch.float32, device=device) if entropy else None
    if rows and valid:
        _kernel()[(rows,)](
            flat, flat.stride(0), valid, 1.0 / temperature, m, s, s if u is None else u,
            ENTROPY=entropy, BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip
    return m, s, u


def softmax_gradient(
    flat: Tensor,
    valid: int,
    temperature: float,
    target: Tensor,
    shift: Tensor,
    total: Tensor,
    g_target: Tensor,
    g_entropy: Tensor | None = None,
    entropy: Tensor | None = None,
) -> Tensor:
    """The gradient with respect to ``flat`` (``[rows, columns]``, this rank's shard) of
    ``sum_r g_target[r] log p_r(target[r]) + g_entropy[r] H_r``, with ``p = softmax(x / T)``
    over the whole vocabulary, in one pass: ``(g_target ([j = target] - p_j) - g_entropy p_j
    (log p_j + H)) / T`` in float32, rounded once to ``flat``'s dtype.

    Args:
        flat: the logits; columns at and past ``valid`` are padding (gradient 0).
        valid: this shard's real columns.
        temperature: ``T``.
        target: int64 per row, the target's column in this shard, or -1 (another rank's, or
            none).
        shift, total: float32 per row, the global maximum of ``x / T`` and ``S = sum exp(x / T -
            shift)`` (:func:`combine_shards`' ``shift`` and ``total``).
        g_target: float32 per row (zeros where only the entropy has a gradient).
        g_entropy, entropy: float32 per row, ``H``'s gradient and ``H`` itself; None: no
            entropy term.

    Returns:
        A new ``[rows, columns]`` tensor in ``flat``'s dtype.
    """
    rows, columns = flat.shape
    out = torch.empty(rows, columns, dtype=flat.dtype, device=flat.device)
    if rows and columns:
        with_entropy = g_entropy is not None
        grid = (rows, -(-columns // _BLOCK))
        _gradient_kernel()[grid](
            flat, flat.stride(0), out, columns, valid, 1.0 / temperature, target, shift, total,
            g_target, g_entropy if with_entropy else g_target,
            entropy if with_entropy else g_target, ENTROPY=with_entropy, BLOCK=_BLOCK,
            num_warps=8,
        )  # fmt: skip
    return out


class Combined(NamedTuple):
    """What :func:`combine_shards` makes of every rank's statistics, per row."""

    #: The maximum over the ranks.
    shift: Tensor
    #: ``S`` over the whole vocabulary, each rank's sum rescaled to ``shift``.
    total: Tensor
    #: ``U / S`` (``U`` rescaled likewise), or None without ``U``.
    mean_z: Tensor | None
    #: The caller's ``extra`` rows, summed over the ranks, or None.
    extra: Tensor | None


def combine_shards(m: Tensor, s: Tensor, u: Tensor | None, tp_group, extra: Tensor | None = None):
    """The global statistics of a row from every rank's :func:`row_statistics`: one MAX
    all-reduce for ``shift``, then one SUM all-reduce of each rank's sums rescaled to it and of
    ``extra`` (``[k, rows]`` float32 rows the caller needs summed too, e.g. the cross entropy's
    target logit from the rank that holds it). Returns :class:`Combined`."""
    shift = m.clone()
    if tp_group is not None and tp_group.size() > 1:
        torch.distributed.all_reduce(shift, op=ReduceOp.MAX, group=tp_group)
    seen = s != 0  # a shard without columns (or of -inf logits only) adds nothing
    delta = torch.where(seen, m - shift, torch.zeros_like(m))
    scale = torch.where(seen, delta.exp(), torch.zeros_like(m))
    parts = [(s * scale).unsqueeze(0)]
    if u is not None:
        parts.append(((u + delta * s) * scale).unsqueeze(0))
    if extra is not None:
        parts.append(extra)
    sums = torch.cat(parts) if len(parts) > 1 else parts[0]
    if tp_group is not None and tp_group.size() > 1:
        torch.distributed.all_reduce(sums, op=ReduceOp.SUM, group=tp_group)
    mean_z = sums[1] / sums[0] if u is not None else None
    rest = sums[2 if u is not None else 1 :] if extra is not None else None
    return Combined(shift, sums[0], mean_z, rest)

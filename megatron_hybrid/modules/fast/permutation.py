"""Token permutation for routed experts with gathers only: no atomics, no loop, no host copy.

megatron-core 0.19.2's local permutation (``permute`` / ``unpermute`` in
``transformer/moe/moe_utils.py``, what its all-to-all dispatcher runs without
TransformerEngine's fused kernels) copies each token to its ``k`` expert rows with
``index_select`` and adds the rows back with ``scatter_add_`` (``index_add_`` under
deterministic algorithms): the unpermutation and the permutation's backward (``index_select``'s
gradient is an ``index_add_``) accumulate rows with atomic adds, one bfloat16 row element at a
time. At the issue's shape (4,096 tokens of width 2,048, top-8) those two kernels took 0.79 ms
per MoE layer and micro-batch on an H100, more than the expert GEMMs' slowest kernel.

Here every direction is a gather. With ``row_token[r]`` the token of permuted row ``r`` (the
rows in megatron's order: by expert, then by token) and ``token_rows[t]`` the ``k`` rows of token
``t`` (by expert), the permutation is ``tokens[row_token]`` and its gradient sums each token's
rows, ``sum_j grad[token_rows[t, j]]``; the unpermutation is that sum, and its gradient
``grad[row_token]``. The sum is one gather-and-sum kernel that accumulates in float32 (Triton on
CUDA, :func:`gather_sum`; ``embedding_bag`` elsewhere) instead of an index copy and a reduction.
Each token has exactly ``k`` rows
whenever no token is dropped and the router pads nothing, which
:func:`~megatron_hybrid.modules.fast.selection.gather_permutation_reason` checks.

At EP > 1 the rows an all-to-all brings come by source rank, then by local expert, and the
experts want them by local expert, then by source rank. megatron-core 0.19.2 sorts them without
TransformerEngine with ``sort_chunks_by_idxs`` (``transformer/moe/moe_utils.py``): a
``torch.split`` into ``ranks x local experts`` pieces and a ``torch.cat`` of them in the new
order, after the dispatch and again before the combine, for the tokens and the probabilities,
and their backwards likewise. At 64 pieces that is hundreds of host operators per MoE layer and
micro-batch (a profiled step at EP 2 on 2 x H200 ran 54,000 operators with them and 34,000
without), and a step at EP > 1 is bound by its host. :func:`chunk_order` computes the same
order on the device, and :func:`reorder_rows` moves the rows with one gather each way.
"""

from __future__ import annotations

import torch
from torch.nn import functional

from megatron_hybrid.triton_lazy import lazy_triton

__all__ = [
    "PermutationMap",
    "chunk_order",
    "gather_sum",
    "gather_sum_reason",
    "inverse_order",
    "permutation_map",
    "permute_probs",
    "permute_tokens",
    "reorder_rows",
    "unpermute_tokens",
]

_BLOCK = 1024  # columns per program; a bound, not a tuning knob (no autotuning)
_MAX_K = 64  # rows summed per token, unrolled in the kernel
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PermutationMap:
    """Where each token's rows go: ``row_token [rows]`` and ``token_rows [tokens, k]``.

    Attributes:
        row_token: the token of each permuted row (megatron's ``sorted_indices``).
        token_rows: the permuted rows of each token, in expert order.
        flat_order: the rows' positions in the expert-major ``[experts, tokens]`` routing map
            (which entry of the transposed probabilities each row takes).
    """

    __slots__ = ("flat_order", "row_token", "token_rows")

    def __init__(self, row_token: torch.Tensor, token_rows: torch.Tensor, flat_order):
        self.row_token, self.token_rows, self.flat_order = row_token, token_rows, flat_order


def permutation_map(routing_map: torch.Tensor, topk: int) -> PermutationMap:
    """The permutation of a dropless top-``topk`` ``routing_map`` (``[tokens, experts]`` bool).

    The rows come in megatron's order (its argsort-based ``permute``: by expert, then by token),
    so the experts see the same rows in the same order as with megatron's dispatcher.
    """
    tokens = routing_map.shape[0]
    flat_order = routing_map.T.contiguous().view(-1).argsort(descending=True, stable=True)
    flat_order = flat_order[: tokens * topk]
    row_token = flat_order % tokens
    # A stable sort by token keeps each token's rows in expert order.
    token_rows = row_token.argsort(stable=True).view(tokens, topk)
    return PermutationMap(row_token, token_rows, flat_order)


@lazy_triton
def _kernel(triton, tl):
    """The Triton gather-sum kernel, or None where Triton cannot be imported."""

    @triton.jit
    def gather_sum_kernel(
        rows_ptr, index_ptr, out_ptr, hidden, K: tl.constexpr, BLOCK: tl.constexpr  # noqa: N803
    ):
        token = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = columns < hidden
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):  # in index order, as embedding_bag adds
            row = tl.load(index_ptr + token * K + j).to(tl.int64)
            total += tl.load(rows_ptr + row * hidden + columns, mask=mask).to(tl.float32)
        tl.store(out_ptr + token * hidden + columns, total.to(out_ptr.dtype.element_ty), mask=mask)

    return gather_sum_kernel, triton.cdiv


def gather_sum_reason(rows: torch.Tensor, index: torch.Tensor) -> str | None:
    """Why :func:`gather_sum` runs ``embedding_bag`` rather than its Triton kernel (None: it
    runs the kernel)."""
    if not rows.is_cuda:
        return "not on CUDA"
    if _kernel() is None:
        return "Triton is not installed"
    if rows.dim() != 2 or index.dim() != 2 or index.shape[1] > _MAX_K:
        return f"not [n, hidden] rows with at most {_MAX_K} per token"
    if rows.dtype not in _DTYPES:
        return f"rows of {rows.dtype}"
    return None


def gather_sum(
    rows: torch.Tensor, index: torch.Tensor, *, use_triton: bool | None = None
) -> torch.Tensor:
    """``out[t] = sum_j rows[index[t, j]]``: ``[tokens, hidden]`` from ``rows [n, hidden]`` and
    ``index [tokens, k]``, without atomics: float32 sums over ``j`` in order, rounded once.

    On CUDA one Triton kernel (a program per token and 1,024 columns) where
    :func:`gather_sum_reason` allows it: ``embedding_bag``'s kernel, which adds the same way,
    took 183 microseconds per call at the issue's shape (4,096 tokens of 2,048, top-8; one
    H200), about six times what its bytes need. Elsewhere ``embedding_bag``.

    Args:
        use_triton: force (True) or forbid (False) the Triton kernel; default: where
            :func:`gather_sum_reason` allows it.
    """
    if index.shape[1] == 1:
        return rows.index_select(0, index.view(-1))
    if use_triton is None:
        use_triton = gather_sum_reason(rows, index) is None
    if not use_triton:
        return functional.embedding_bag(index, rows, mode="sum")
    kernel, cdiv = _kernel()
    rows, index = rows.contiguous(), index.contiguous()
    tokens, hidden = index.shape[0], rows.shape[1]
    out = rows.new_empty(tokens, hidden)
    if tokens:
        grid = (tokens, cdiv(hidden, _BLOCK))
        kernel[grid](rows, index, out, hidden, K=index.shape[1], BLOCK=_BLOCK)
    return out


class _Permute(torch.autograd.Function):
    """``tokens[row_token]``; backward: each token's rows summed."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, row_token: torch.Tensor, token_rows: torch.Tensor):
        ctx.save_for_backward(token_rows)
        return tokens.index_select(0, row_token)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows: torch.Tensor):
        (token_rows,) = ctx.saved_tensors
        return gather_sum(grad_rows.contiguous(), token_rows), None, None


class _Unpermute(torch.autograd.Function):
    """Each token's rows summed; backward: ``grad[row_token]``."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, row_token: torch.Tensor, token_rows: torch.Tensor):
        ctx.save_for_backward(row_token)
        return gather_sum(rows.contiguous(), token_rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_tokens: torch.Tensor):
        (row_token,) = ctx.saved_tensors
        return grad_tokens.contiguous().index_select(0, row_token), None, None


class _TakeUnique(torch.autograd.Function):
    """``values[index]`` for an index without repeats; backward: a scatter (no accumulation),
    or, given the ``inverse`` of a permutation ``index``, a gather (no zero-filled buffer)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, index: torch.Tensor, inverse=None):
        ctx.save_for_backward(index if inverse is None else inverse)
        ctx.permutation = inverse is not None
        ctx.size = values.shape[0]
        return values.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        if ctx.permutation:
            return grad.index_select(0, index), None, None
        out = grad.new_zeros((ctx.size, *grad.shape[1:]))
        return out.index_copy_(0, index, grad), None, None


def permute_probs(probs: torch.Tensor, mapping: PermutationMap) -> torch.Tensor:
    """``[rows]``: each row's routing probability (``probs`` ``[tokens, experts]``), as
    megatron's ``permute`` takes it from the transposed probabilities."""
    return _TakeUnique.apply(probs.T.contiguous().view(-1), mapping.flat_order)


def permute_tokens(tokens: torch.Tensor, mapping: PermutationMap) -> torch.Tensor:
    """``[rows, hidden]``: each token of ``tokens [tokens, hidden]`` copied to its ``k`` rows."""
    return _Permute.apply(tokens, mapping.row_token, mapping.token_rows)


def unpermute_tokens(rows: torch.Tensor, mapping: PermutationMap) -> torch.Tensor:
    """``[tokens, hidden]``: the sum of each token's ``k`` rows (``rows`` ``[rows, hidden]``)."""
    return _Unpermute.apply(rows, mapping.row_token, mapping.token_rows)


def chunk_order(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows of chunks laid out by ``counts``'s rows, then its columns, taken by its columns,
    then its rows: ``out[j] = rows_in[order[j]]``.

    ``counts [chunks, experts]`` (on the rows' device) holds each chunk's rows: received from
    source rank ``c`` for local expert ``e`` at ``counts[c, e]``, in that order. The result takes
    them by local expert, then by source rank, as megatron's ``sort_chunks_by_idxs`` with
    ``sort_input_by_local_experts`` does; its inverse (:func:`inverse_order`, or
    ``chunk_order(counts.T, rows)``) takes the experts' output back by source rank, as
    ``restore_output_by_local_experts``. No host copy: ``rows`` (their sum, which the
    all-to-all's output size gives the host) sizes the result.
    """
    chunks, experts = counts.shape
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(chunks, experts)  # where each chunk begins
    taken = counts.T.reshape(-1)  # the chunks in the order they are taken
    # Row j of taken chunk k comes from starts[k] + (j - where chunk k begins in the output).
    shift = starts.T.reshape(-1) - (torch.cumsum(taken, 0) - taken)
    return torch.arange(rows, device=counts.device) + torch.repeat_interleave(
        shift, taken, output_size=rows
    )


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The inverse of the permutation ``order``: ``inverse[order[j]] = j`` (one scatter)."""
    positions = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, positions)


def reorder_rows(values: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``values[order]``, rows moved by a permutation, and ``inverse`` its inverse: a gather
    forward and backward (:func:`chunk_order` and :func:`inverse_order`)."""
    return _TakeUnique.apply(values, order, inverse)

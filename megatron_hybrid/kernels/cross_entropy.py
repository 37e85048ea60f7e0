"""The language model's cross entropy on vocab-parallel logits: one Triton pass over the logits
each way.

megatron-core's fused cross entropy (0.19.2, ``fusions/fused_cross_entropy.py``, what
``cross_entropy_loss_fusion`` with ``cross_entropy_fusion_impl="native"`` runs) makes a float32
copy of the logits, subtracts the row maximum from it in place, exponentiates it, divides it by
the row sum and keeps that float32 softmax for the backward pass, which subtracts one at the
target and scales it: five compiled kernels, each reading or writing a float32 array twice the
size of bf16 logits. At the shape of issue 33 (8 micro-batches of 4,096 tokens, vocabulary
32,768) they took about 12 ms of a 177 ms step on one H200 and held 512 MiB per micro-batch
until its backward pass.

:func:`vocab_parallel_cross_entropy` computes the same function from two passes:

* forward: the row statistics of :mod:`~megatron_hybrid.kernels.vocab_rows` (the maximum ``m``
  and ``S = sum exp(x - m)``, one read of the logits in their own dtype) and the target's logit,
  combined over the tensor-parallel group as megatron's fused version does (a MAX all-reduce,
  then one SUM all-reduce of ``S`` and the target's logit); ``loss = log S - (x[target] - m)``
  in float32, ``log S`` where the target is outside the vocabulary (megatron's value);
* backward: ``(exp(x - m) / S - [j == target]) * grad`` in float32, rounded once to the logits'
  dtype, one read of the logits and one write of their gradient (``vocab_rows.softmax_gradient``,
  which the log-probs' backward runs too).

It keeps the logits (bf16: half the bytes of megatron's float32 softmax) and a few numbers per row.
As in megatron, every column of this rank's shard counts (the padded vocabulary too) and a
target outside the shard adds nothing to its gradient; the loss has the targets' shape. The
gradient is in the logits' dtype, as megatron's unfused version returns it (the fused one
returns bf16 whatever the logits are).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megatron_hybrid.kernels.vocab_rows import (
    combine_shards,
    kernel_reason,
    row_statistics,
    softmax_gradient,
)

__all__ = ["OFF_ENV", "cross_entropy_reason", "vocab_parallel_cross_entropy"]

#: ``0`` keeps megatron's compiled fused cross entropy (for comparisons).
OFF_ENV = "MEGATRON_HYBRID_TRITON_CROSS_ENTROPY"


def cross_entropy_reason(logits: Tensor) -> str | None:
    """Why :func:`vocab_parallel_cross_entropy` cannot take ``logits`` (``[..., vocab shard]``),
    or None."""
    if os.environ.get(OFF_ENV) == "0":
        return f"{OFF_ENV}=0"
    if logits.dim() < 1 or not logits.is_contiguous():
        return "logits that are not one contiguous array"
    return kernel_reason(logits.view(-1, logits.size(-1)))


class _CrossEntropy(torch.autograd.Function):
    """``loss = log S - (x[target] - m)`` per row; see the module docstring."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, tp_group) -> Tensor:
        columns = logits.size(-1)
        flat = logits.view(-1, columns)
        rank, size = (0, 1) if tp_group is None else (tp_group.rank(), tp_group.size())
        target = target.reshape(-1).to(torch.int64)
        local = target - rank * columns
        mine = (local >= 0) & (local < columns)
        # x[target] from the rank that holds it (0 elsewhere), summed with S in one all-reduce.
        picked = flat.gather(-1, local.clamp(0, columns - 1).unsqueeze(-1)).squeeze(-1).float()
        picked = torch.where(mine, picked, torch.zeros_like(picked))
        m, s, _ = row_statistics(flat, columns, 1.0, False)
        combined = combine_shards(m, s, None, tp_group, extra=picked.unsqueeze(0))
        # x[target] - m, exact as megatron's; 0 for a target outside the vocabulary (megatron's
        # value, e.g. for an ignored -100: the loss is then log S).
        inside = (target >= 0) & (target < columns * size)
        shifted = torch.where(inside, combined.extra[0] - combined.shift, 0.0)
        ctx.save_for_backward(logits, torch.where(mine, local, -1), combined.shift, combined.total)
        return (combined.total.log() - shifted).view(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: Tensor):
        logits, local, shift, total = ctx.saved_tensors
        columns = logits.size(-1)
        # d loss / d x = -(d log p(target) / d x) * grad: the softmax gradient with g = -grad.
        g_target = grad_loss.reshape(-1).float().neg().contiguous()
        grad = softmax_gradient(logits.view(-1, columns), columns, 1.0, local, shift, total,
                                g_target)  # fmt: skip
        return grad.view_as(logits), None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, tp_group=None) -> Tensor:
    """megatron-core's ``fused_vocab_parallel_cross_entropy`` in two Triton passes.

    Args:
        logits: this rank's vocabulary shard of the logits, ``[..., V / tp]``, contiguous (see
            :func:`cross_entropy_reason`).
        target: token ids, the logits' shape without the vocabulary dimension.
        tp_group: the tensor-parallel group the vocabulary is split over (None: not split).

    Returns:
        The float32 loss per token, ``target``'s shape; differentiable in ``logits``.
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target {tuple(target.shape)} must have the logits' shape without the vocabulary "
            f"dimension, {tuple(logits.shape[:-1])}"
        )
    return _CrossEntropy.apply(logits, target, tp_group)

"""The float64 cross entropy of logits and the float32 error bounds of the package's Triton
cross entropy (``kernels/cross_entropy.py``) and of megatron-core's, for its CPU and GPU tests.

Bounds, from float32 error analysis of the kernels' own order of operations (``u = 2^-24``), per
row of ``n`` columns over ``world`` ranks, ``k`` blocks of 4,096 columns per rank and ``R`` the
row's range (largest minus smallest logit):

* ``S = sum exp(x - m)`` (:func:`rel_sum_bound`): each of the 4,096 lanes keeps a running sum of
  at most ``k`` terms, a multiply and an add per step (``4 k u`` with the rescaling's
  exponential); the exponentials' arguments carry ``u |z|`` each, whose weighted sum is at most
  ``u`` times the softmax's entropy, ``<= u ln n``; the rescalings' arguments (a lane's maximum
  against a later one, a lane against the row, a rank against the group) add at most ``3 R u``;
  the sum over lanes is a tree of 12 levels (``12 u``), the ranks' sum ``world u``, and ``8 u``
  for the remaining roundings;
* loss ``= log S - (x_t - m)``: ``S``'s relative error, the logarithm's ``2 u |log S|``, and one
  rounding each of ``x_t - m`` and of the difference;
* gradient ``(exp(x - m) / S - [j = t]) g``: the softmax carries ``S``'s error, ``2 u |x - m|``
  from the subtraction and the exponential's argument, ``4 u`` from the exponential and the
  division; then two float32 roundings of the result and one to the logits' dtype (``rounding``
  of the value; below the dtype's normal range the spacing of its subnormals).

megatron's own cross entropy sums with torch's reductions, whose order is not documented; it is
held to the generic bound of ``n`` float32 additions, ``2 (n + 16) u``, in place of ``S``'s.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "NEAREST", "SUBNORMAL", "U", "exact_cross_entropy", "rel_sum_bound"]

U = 2.0**-24
BLOCK = 4096  # the statistics kernel's lanes (kernels/vocab_rows.py)
#: Half a unit in the last place: rounding to nearest.
NEAREST = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
#: The spacing of the dtype's subnormals (float16's, 2^-24, matters: softmax entries of 1e-8).
SUBNORMAL = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}


def rel_sum_bound(x: torch.Tensor, world: int) -> torch.Tensor:
    """Relative error bound of the kernels' ``S`` per row of ``x`` (float64 ``[rows, n]``)."""
    n = x.size(-1)
    blocks = -(-n // world // BLOCK)
    spread = x.amax(-1) - x.amin(-1)
    return U * (4 * blocks + 12 + world + 8 + torch.log(torch.tensor(float(n))) + 3 * spread)


def exact_cross_entropy(logits, target, grad, world: int, rounding: float):
    """megatron's cross entropy of ``logits`` (``[rows, n]``, the whole vocabulary) in float64:
    ``(loss, gradient, (loss bound, gradient bound), (megatron's loss bound, gradient bound))``
    for targets ``target`` (outside ``[0, n)``: megatron's ignored target, loss ``log S``) and
    the loss's gradient ``grad`` per row; ``rounding``: the gradient's rounding to the logits'
    dtype, relative."""
    x = logits.double()
    vocab = x.size(-1)
    m = x.amax(-1, keepdim=True)
    log_sum = (x - m).exp().sum(-1, keepdim=True).log()
    inside = (target >= 0) & (target < vocab)
    # x[t] - m; 0 (megatron's value: the loss is log S) for a target outside the vocabulary.
    picked = x.gather(-1, target.clamp(0, vocab - 1)[:, None])[:, 0] - m[:, 0]
    picked = torch.where(inside, picked, 0.0)
    loss = log_sum[:, 0] - picked
    softmax = (x - m - log_sum).exp()
    gradient = softmax.clone()
    rows = torch.arange(x.size(0), device=x.device)[inside]
    gradient[rows, target[inside]] -= 1
    scale = grad.double().reshape(-1, 1)
    gradient *= scale
    subnormal = SUBNORMAL[logits.dtype]

    def bounds(rel_sum: torch.Tensor):
        loss_bound = rel_sum + U * (2 * log_sum[:, 0].abs() + picked.abs() + loss.abs())
        grad_bound = softmax * scale * (rel_sum[:, None] + 2 * U * (x - m).abs() + 4 * U)
        return loss_bound, grad_bound + (2 * U + rounding) * gradient.abs() + subnormal

    generic = torch.full_like(loss, 2 * (vocab + 16) * U)
    return loss, gradient, bounds(rel_sum_bound(x, world)), bounds(generic)

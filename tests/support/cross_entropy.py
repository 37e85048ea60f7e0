"""The float64 cross entropy and log-prob gradients of logits, and the float32 error bounds of the
package's Triton cross entropy (``kernels/cross_entropy.py``), of megatron-core's, and of the
log-probs' gradient pass (``kernels/vocab_rows.py``), for their CPU and GPU tests.

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

__all__ = [
    "BLOCK",
    "NEAREST",
    "SUBNORMAL",
    "U",
    "exact_cross_entropy",
    "exact_logprob_gradient",
    "rel_sum_bound",
]

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


def exact_logprob_gradient(logits, labels, temperature, vocab, world, g_lp, g_h, rounding):
    """float64 autograd's gradient of ``g_lp . log p(label) (+ g_h . H)`` with ``p =
    softmax(logits[:, :vocab] / T)`` (the padding columns' gradient is 0), and the bound of the
    kernel's ``(g_lp ([j = t] - p) - g_h p (log p + H)) / T`` from the row sum's relative error
    ``e`` (:func:`rel_sum_bound` on ``z = x / T``):

    * ``p_j`` is off by ``p_j (e + u (2 |z_j - m| + |log S| + 8))`` (the subtraction, the
      exponential, ``S`` saved as ``log S`` and back, the division);
    * ``log p_j = z_j - m - log S`` by ``e + u (|z_j - m| + 3 |log S| + 4)``;
    * ``H = log S - U / S`` by ``e (2 + 2 ln n) + 2 u |log S|`` (``U`` sums terms of one sign,
      with ``S``'s structure; ``|U / S| <= ln n``);

    then three float32 roundings of the result and one to the dtype (``rounding``, relative).
    ``g_h`` None: no entropy term."""
    x = logits.double().requires_grad_()
    log_p = torch.log_softmax(x[:, :vocab] / temperature, -1)
    h = -(log_p.exp() * log_p).sum(-1)
    g_lp = g_lp.to(x.device, torch.float64)
    total = (log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1) * g_lp).sum()
    if g_h is not None:
        g_h = g_h.to(x.device, torch.float64)
        total = total + (h * g_h).sum()
    total.backward()
    with torch.no_grad():
        p, z = log_p.exp(), x[:, :vocab] / temperature
        z_m = (z - z.amax(-1, keepdim=True)).abs()
        log_sum = (-z_m).exp().sum(-1, keepdim=True).log()
        e = rel_sum_bound(z, world)[:, None]
        e_p = e + U * (2 * z_m + log_sum + 8)
        e_log = e + U * (z_m + 3 * log_sum + 4)
        e_h = e * (2 + 2 * torch.log(torch.tensor(float(vocab)))) + 2 * U * log_sum
        bound = torch.zeros_like(x)
        bound[:, :vocab] = g_lp.abs()[:, None] * p * e_p
        if g_h is not None:
            term = e_p * (log_p + h[:, None]).abs() + e_log + e_h
            bound[:, :vocab] += g_h.abs()[:, None] * p * term
        bound /= temperature
        bound += (3 * U + rounding) * x.grad.abs() + SUBNORMAL[logits.dtype]
    return x.grad, bound

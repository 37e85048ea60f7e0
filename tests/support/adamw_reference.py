"""AdamW with megatron's gradient clipping in float64, and how far float32 may be from it.

The oracle of ``train``'s optimizer step (``training/optimizer_step.py``) in the CPU and GPU
tests. :data:`EXACT` are hyper-parameters exactly representable in float32 (betas 7/8 and
15/16, so ``1 - beta`` and the bias corrections ``1 - beta ** t`` of up to six steps are exact
too): a float32 AdamW then differs from :func:`adamw_float64` only by the rounding of the
gradient norm and of Adam's own arithmetic, which :func:`rounding_bound` adds up to first order
along the float64 trajectory (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
ch. 3: ``gamma_n = n u / (1 - n u)`` for a sum of ``n`` terms, ``u = 2 ** -24``): the norm's
relative error ``gamma_n / 2`` plus the clip factor's and the product's roundings; the first
moment's error relative to the moment of ``|g|`` (its terms have mixed signs), the second's
relative to itself (``3 u`` per step), the square root, ``eps``, the division, the scaling by the
learning rate, the weight decay and the subtraction from the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DEFERRED_ROUNDINGS",
    "EXACT",
    "Hyper",
    "adamw_float64",
    "gamma",
    "gradient_error",
    "rounding_bound",
]

U = 2.0**-24


def gamma(n: int) -> float:
    """``n u / (1 - n u)``: the relative error bound of a float32 sum of ``n`` terms."""
    return n * U / (1 - n * U)


#: Roundings a deferred token factor ``s = 1 / tokens`` adds to each gradient (``train_step``'s
#: fused path, ``training/optimizer_step.py``): ``s`` itself, its square in the norm (1.5 after
#: the square root), the product with the clip factor, the reciprocal handed to the kernel and
#: the kernel's division; megatron's path rounds ``g * s`` once where the gradient is scaled.
DEFERRED_ROUNDINGS = 6


def gradient_error(elements: int, extra_roundings: int = 0) -> float:
    """Relative error of a clipped float32 gradient: the norm over ``elements`` (``gamma_n / 2``
    after the square root), its square root, the clip factor and the product, plus
    ``extra_roundings``."""
    return gamma(elements) / 2 + (4 + extra_roundings) * U


@dataclass(frozen=True)
class Hyper:
    """AdamW's hyper-parameters and the clipping norm (0: none)."""

    lr: float
    weight_decay: float
    eps: float
    betas: tuple[float, float]
    clip: float


#: Hyper-parameters whose float32 arithmetic is exact where it can be (see the module doc).
EXACT = Hyper(lr=2.0**-7, weight_decay=2.0**-6, eps=2.0**-27, betas=(0.875, 0.9375), clip=1.0)


def adamw_float64(
    initial: Sequence[torch.Tensor], grads_by_step: Sequence[Sequence[torch.Tensor]], hyper: Hyper
):
    """``(parameters, trajectory)`` after AdamW steps on ``grads_by_step`` in float64, each
    step's gradients clipped by their global norm as megatron clips them; ``trajectory`` holds
    per step and parameter what :func:`rounding_bound` needs."""
    (b1, b2), params = hyper.betas, [p.detach().double().clone() for p in initial]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    m_abs = [torch.zeros_like(p) for p in params]
    trajectory = []
    for t, grads in enumerate(grads_by_step, start=1):
        grads = [g.detach().double() for g in grads]
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        factor = min(1.0, hyper.clip / (norm + 1e-6)) if hyper.clip > 0 else 1.0
        correction1, correction2 = 1 - b1**t, 1 - b2**t
        step = []
        for i, g in enumerate(g * factor for g in grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            m_abs[i] = b1 * m_abs[i] + (1 - b1) * g.abs()
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = (v[i] / correction2).sqrt() + hyper.eps
            params[i] = params[i] * (1 - hyper.lr * hyper.weight_decay)
            params[i] = params[i] - hyper.lr * (m[i] / correction1) / denom
            step.append(
                dict(m=m[i] / correction1, m_abs=m_abs[i] / correction1, denom=denom, p=params[i])
            )
        trajectory.append(step)
    return params, trajectory


def rounding_bound(
    trajectory, elements: int, hyper: Hyper, extra_roundings: int = 0
) -> list[torch.Tensor]:
    """Per element, how far a float32 AdamW with a float32 gradient norm over ``elements``
    gradient elements may be from :func:`adamw_float64` (first order; see the module doc);
    ``extra_roundings`` of each gradient as :func:`gradient_error` counts them."""
    delta_g = gradient_error(elements, extra_roundings)
    bounds = [torch.zeros_like(s["p"]) for s in trajectory[0]]
    for t, step in enumerate(trajectory, start=1):
        for i, s in enumerate(step):
            e_m = (2 * t * U + delta_g) * s["m_abs"] + U * s["m"].abs()
            e_denom = (3 * t * U + 2 * delta_g) / 2 + 3 * U
            ratio = (s["m"].abs() * (e_denom + 2 * U) + e_m) / s["denom"]
            p = s["p"].abs()
            bounds[i] = (
                bounds[i] + hyper.lr * ratio + 2 * U * p + U * hyper.lr * hyper.weight_decay * p
            )
    return bounds

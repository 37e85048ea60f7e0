"""Machine-independent estimates of float32 rounding error, for the bounds of numerical tests.

Two float32 evaluations of the same function (a fast path and its reference, ours and
transformers') differ by their rounding errors, which depend on the machine (vector width,
summation order, threads). A bound set to a few times the difference seen on one machine fails
on the next. These helpers derive the scale from the computation instead.

:class:`RoundingJitter` is a dispatch mode that multiplies the output of every aten operation
that computes something (a floating tensor in, a fresh floating tensor out: no views, no in-place
updates) by ``1 + eps * N(0, 1)``, element by element, in the forward and the backward pass.
That is the standard model of floating-point arithmetic (``fl(x op y) = (x op y)(1 + d)``,
``|d| <= u``) with the rounding of each operation made random and ``eps`` large enough
(``2^-16``, 256 float32 unit roundoffs) that the machine's own rounding is under a percent of
the response. :func:`float32_error_scale` measures how far that moves a result and scales the
response down linearly to ``u = 2^-24``: the size of the float32 error of *any* correct
evaluation of the function, condition number included (cancellation in a gradient's sum over
tokens, a recurrence that amplifies its inputs), and the same on every machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

#: Unit roundoff of float32 (round to nearest).
FLOAT32_U = 2.0**-24

#: How many rounding scales two float32 evaluations of one function may differ by: both err
#: (2), and one machine's actual rounding can exceed the largest response of two jitter draws
#: (2). Errors seen on the machines this was checked on stay 6x or more under it.
ROUNDING_MARGIN = 4

#: Relative size of the simulated roundings: large against the machine's own float32 rounding,
#: small enough that results respond linearly.
JITTER_EPS = 2.0**-16


def _computes(func, args, kwargs) -> bool:
    """Whether ``func`` returns fresh tensors computed from floating inputs."""
    schema = func._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return False  # in-place, out= and view ops keep their aliasing
    inputs = [*args, *kwargs.values()]
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in inputs)


class RoundingJitter(TorchDispatchMode):
    """Every computing aten op's floating outputs times ``1 + eps * N(0, 1)`` (seeded)."""

    def __init__(self, eps: float, seed: int) -> None:
        super().__init__()
        self.eps, self.seed = eps, seed
        self.generator = torch.Generator().manual_seed(seed)

    def _jitter(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return tensor
        noise = torch.randn(tensor.shape, generator=self.generator, dtype=torch.float64)
        return tensor * (1 + self.eps * noise).to(tensor.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _computes(func, args, kwargs):
            return out
        return tree_map_only(torch.Tensor, self._jitter, out)


def float32_error_scale(
    evaluate: Callable[[AbstractContextManager], dict[str, torch.Tensor]],
    *,
    measure: Callable[[torch.Tensor, torch.Tensor], float],
    draws: int = 2,
    sizes: tuple[float, ...] = (JITTER_EPS,),
) -> dict[str, float]:
    """The float32 rounding error to expect in each result of ``evaluate``.

    Args:
        evaluate: ``evaluate(rounding)`` runs the computation from scratch (same inputs every
            call) with its arithmetic (not its set-up: building or loading a model) inside the
            context manager ``rounding``, and returns named results (logits, gradients, a loss).
        measure: ``(jittered, clean) -> distance``, e.g. a max abs difference or a relative
            error; it must scale linearly with the difference.
        draws: Seeded jitter draws; the largest response is kept.
        sizes: Relative sizes of the simulated roundings (``RoundingJitter.eps``); each response
            is scaled to ``u`` and the largest kept. More than one where a result may respond
            less than linearly (an update that saturates, as Adam's for gradients near zero).

    Returns:
        ``name -> measure`` of the response to roundings of relative size ``u = 2^-24``.
    """
    clean = evaluate(contextlib.nullcontext())
    scale: dict[str, float] = {}
    for eps in sizes:
        for seed in range(draws):
            jittered = evaluate(RoundingJitter(eps, seed))
            for name, value in clean.items():
                moved = measure(jittered[name], value) * FLOAT32_U / eps
                scale[name] = max(scale.get(name, 0.0), moved)
    return scale


def float32_bounds(
    evaluate: Callable[[AbstractContextManager], dict[str, torch.Tensor]],
    *,
    measure: Callable[[torch.Tensor, torch.Tensor], float],
    floor: float,
    sizes: tuple[float, ...] = (JITTER_EPS,),
) -> dict[str, float]:
    """``name -> max(floor, ROUNDING_MARGIN * scale)``: how far two correct float32 evaluations
    of ``evaluate``'s results may lie apart on any machine (see :func:`float32_error_scale`)."""
    scale = float32_error_scale(evaluate, measure=measure, sizes=sizes)
    return {name: max(floor, ROUNDING_MARGIN * value) for name, value in scale.items()}


def bounds_of(
    compute: Callable[[], dict[str, torch.Tensor]],
    *,
    measure: Callable[[torch.Tensor, torch.Tensor], float],
    floor: float,
) -> dict[str, float]:
    """:func:`float32_bounds` of a computation that is all arithmetic: ``compute()`` takes
    prepared inputs (the same every call) and runs whole inside the simulated rounding."""

    def evaluate(rounding: AbstractContextManager) -> dict[str, torch.Tensor]:
        with rounding:
            return compute()

    return float32_bounds(evaluate, measure=measure, floor=floor)


def outside(
    results: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    bounds: dict[str, float],
    measure: Callable[[torch.Tensor, torch.Tensor], float],
) -> list[tuple[str, float, float]]:
    """``(name, distance, bound)`` of every result farther from ``reference`` than its bound
    (empty: all within)."""
    distances = {name: measure(results[name], value) for name, value in reference.items()}
    return [(name, d, bounds[name]) for name, d in distances.items() if not d <= bounds[name]]


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` in float64."""
    return (a.double() - b.double()).abs().max().item()


__all__ = [
    "FLOAT32_U",
    "JITTER_EPS",
    "ROUNDING_MARGIN",
    "RoundingJitter",
    "bounds_of",
    "float32_bounds",
    "float32_error_scale",
    "max_abs",
    "outside",
]

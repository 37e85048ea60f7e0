"""Why GatedDeltaNet's ``A_log`` / ``dt_bias`` gradients are far off in bf16: a principled bound.

The layer computes the per-token log decay ``g = -exp(A_log) * softplus(alpha + dt_bias)`` in
torch and hands ``g`` to the kernel (fla's ``chunk_gated_delta_rule`` or megatron's torch rule),
which returns ``dg = dL/dg``. The gate parameters' gradients are then reductions over every token
``t`` (and batch row) of head ``h``::

    dL/dA_log[h]   = sum_t dg[t, h] * g[t, h]                      (dg/dA_log = g)
    dL/ddt_bias[h] = sum_t dg[t, h] * w[t, h],   w = -exp(A_log) * sigmoid(alpha + dt_bias)

so with ``dg`` off by ``delta`` and ``g`` by ``epsilon`` (Cauchy-Schwarz, per head)::

    |error of dL/dA_log[h]| <= ||delta_h|| ||g_h|| + ||dg_h|| ||epsilon_h||

and relative to the gradient the kernel's relative ``dg`` error is multiplied by the
*amplification* ``kappa_h = ||dg_h|| ||g_h|| / |sum_t dg g|`` (1 / |cos| of the angle between
``dg`` and ``g``). ``kappa`` is a property of the model and the batch, not of any kernel: it is in
the hundreds already for small random models (cancelling sums), so a ``dg`` with bf16 error
(~4e-3 relative, fla keeps bf16 intermediates) gives gate gradients off by O(1) while every other
gradient is fine. That is cancellation. A *defect* in how the gates reach the kernel (a wrong
dtype, scale or derivative of the gate) shows instead as gate-gradient errors beyond the bound
computed from the ``dg`` and ``g`` that the kernel actually saw, or as a ``dg`` that is wrong in
float32 too.

:func:`gate_gradients` runs one rule on one set of gate inputs; :func:`gate_report` compares a
run with a reference run per head and gives the verdict; :func:`record_gates` captures ``g`` and
``dg`` of every GatedDeltaNet layer of a model, for the same analysis at model level.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.nn.functional import softplus

__all__ = [
    "RULE_TENSORS",
    "GateReport",
    "cauchy_schwarz_bound",
    "gate_gradients",
    "gate_report",
    "gate_weights",
    "record_gates",
    "replay_rule",
]


def gate_weights(g: torch.Tensor, a_log: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dg/dA_log, dg/ddt_bias)`` per token (float64) from the ``g`` a kernel saw.

    ``dg/dA_log = g``; ``dg/ddt_bias = -exp(A_log) sigmoid(x)`` with ``x = alpha + dt_bias``,
    and ``sigmoid(x) = 1 - exp(-softplus(x)) = -expm1(g / exp(A_log))``, so neither ``alpha`` nor
    ``dt_bias`` is needed.
    """
    g = g.detach().double()
    a = a_log.detach().double().exp()
    return g, a * torch.expm1(g / a)


def gate_gradients(
    rule: Callable,
    inputs: dict[str, torch.Tensor],
    grad_out: torch.Tensor,
    dtype: torch.dtype,
    *,
    gate: Callable | None = None,
) -> dict[str, torch.Tensor]:
    """Run ``rule`` on ``inputs`` in ``dtype`` and return the gate parameters' gradients.

    Args:
        rule: ``(q, k, v, g, beta) -> out`` (or ``(out, state)``), e.g. fla's
            ``chunk_gated_delta_rule``.
        inputs: ``q, k, v`` ``[B, T, H, K|V]``, ``beta, alpha`` ``[B, T, H]``, ``A_log, dt_bias``
            ``[H]``.
        grad_out: the upstream gradient of the output.
        dtype: the dtype of the rule's inputs and of ``A_log``/``dt_bias`` (as a bf16 model has
            them); ``g`` is float32 (or float64 in a float64 run), as megatron passes it.
        gate: ``(A_log, dt_bias, alpha) -> g``; default: exp and softplus in float32.

    Returns:
        float64 ``dA_log``, ``ddt_bias`` ``[H]``, ``dg`` and ``g`` ``[B, T, H]`` and ``out``.
    """
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    a_log = inputs["A_log"].to(dtype).clone().requires_grad_()
    dt_bias = inputs["dt_bias"].to(dtype).clone().requires_grad_()
    if gate is None:
        # alpha comes out of the input projection in the model's dtype.
        alpha = inputs["alpha"].to(dtype).to(wide)
        g = -a_log.to(wide).exp() * softplus(alpha + dt_bias.to(wide))
    else:
        g = gate(a_log, dt_bias, inputs["alpha"].to(dtype))
    g.retain_grad()
    qkvb = [inputs[n].to(dtype) for n in ("q", "k", "v")]
    out = rule(*qkvb, g, inputs["beta"].to(dtype))
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_out.to(out.dtype))
    return dict(
        dA_log=a_log.grad.double(),
        ddt_bias=dt_bias.grad.double(),
        dg=g.grad.double(),
        g=g.detach().double(),
        out=out.detach().double(),
    )


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` -> ``[N, H]`` (tokens and batch rows flattened)."""
    return x.reshape(-1, x.shape[-1])


def cauchy_schwarz_bound(dg, g, dg_ref, g_ref, weight=None, weight_ref=None) -> torch.Tensor:
    """Per head: ``||dg - dg_ref|| ||w|| + ||dg_ref|| ||w - w_ref||`` with ``w`` the gate weight
    (``g`` itself for ``A_log``)."""
    w = g if weight is None else weight
    w_ref = g_ref if weight_ref is None else weight_ref
    dg, w, dg_ref, w_ref = (_per_head(x.double()) for x in (dg, w, dg_ref, w_ref))
    return (dg - dg_ref).norm(dim=0) * w.norm(dim=0) + dg_ref.norm(dim=0) * (w - w_ref).norm(dim=0)


def amplification(dg, weight) -> torch.Tensor:
    """Per head ``||dg|| ||w|| / |sum dg w|``: how much a relative ``dg`` error grows."""
    dg, weight = _per_head(dg.double()), _per_head(weight.double())
    return dg.norm(dim=0) * weight.norm(dim=0) / (dg * weight).sum(0).abs()


@dataclass(frozen=True)
class GateReport:
    """One run's gate gradients against a reference run, per head.

    Attributes:
        dg_error: norm-relative error of ``dg`` (the kernel's part).
        kappa_a_log, kappa_dt_bias: the reference's amplification per head.
        error_a_log, error_dt_bias: absolute gradient errors per head.
        bound_a_log, bound_dt_bias: the Cauchy-Schwarz bounds per head (plus ``rounding`` of the
            gradient itself).
        verdict: ``"consistent"`` (``dg`` within its precision and every gate error within its
            bound: whatever the size, it is the ``dg``/``g`` error amplified by cancellation) or
            ``"defect: ..."`` naming what is off.
    """

    dg_error: float
    kappa_a_log: list[float]
    kappa_dt_bias: list[float]
    error_a_log: list[float]
    error_dt_bias: list[float]
    bound_a_log: list[float]
    bound_dt_bias: list[float]
    verdict: str


def gate_report(
    run: dict,
    reference: dict,
    weights: tuple,
    weights_ref: tuple,
    *,
    rounding: float = 0.0,
    dg_bound: float | None = None,
) -> GateReport:
    """Compare ``run`` (from :func:`gate_gradients` or a model) with ``reference``.

    Args:
        run, reference: dicts with ``dA_log``, ``ddt_bias``, ``dg``, ``g``.
        weights, weights_ref: ``(dg/dA_log, dg/ddt_bias)`` per token of each run
            (:func:`gate_weights` of the ``g`` and ``A_log`` each run had).
        rounding: relative rounding of the gradients themselves (a bf16 parameter's gradient
            is rounded to bf16: pass ``2 ** -7`` for two roundings).
        dg_bound: the norm-relative ``dg`` error the kernel's precision allows (None: not
            checked); beyond it the kernel's gradient itself is a defect.
    """
    dg_error = float((run["dg"] - reference["dg"]).norm() / reference["dg"].norm())
    out = {}
    for name, index in (("a_log", 0), ("dt_bias", 1)):
        bound = cauchy_schwarz_bound(
            run["dg"], run["g"], reference["dg"], reference["g"], weights[index], weights_ref[index]
        )
        key = "dA_log" if name == "a_log" else "ddt_bias"
        grad, grad_ref = run[key], reference[key]
        bound = bound + rounding * grad.abs() + 1e-12
        out[name] = (
            amplification(reference["dg"], weights_ref[index]).tolist(),
            (grad - grad_ref).abs().tolist(),
            bound.tolist(),
        )
    broken = (
        []
        if dg_bound is None or dg_error <= dg_bound
        else [f"kernel dg error {dg_error:.3g} > {dg_bound:.3g}"]
    )
    broken += [
        f"{name} head {h}: error {e:.3g} > bound {b:.3g}"
        for name, (_, errors, bounds) in out.items()
        for h, (e, b) in enumerate(zip(errors, bounds, strict=True))
        if not e <= b * (1 + 1e-6)
    ]
    return GateReport(
        dg_error=dg_error,
        kappa_a_log=out["a_log"][0],
        kappa_dt_bias=out["dt_bias"][0],
        error_a_log=out["a_log"][1],
        error_dt_bias=out["dt_bias"][1],
        bound_a_log=out["a_log"][2],
        bound_dt_bias=out["dt_bias"][2],
        verdict="consistent" if not broken else "defect: " + "; ".join(broken),
    )


#: The gradients (and output) :func:`replay_rule` returns, by the name of what they belong to.
RULE_TENSORS = ("out", "q", "k", "v", "g", "beta")


def replay_rule(rule: Callable, call: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Run ``rule`` again on one recorded call (:func:`record_gates`), forward and backward.

    ``q, k, v, beta`` and the output gradient go in as ``dtype`` (rounded, for a bf16 run of a
    float32 recording), ``g`` in float32 as the layer passes it (float64 in a float64 run).
    Returns float64 ``out`` and the gradients ``q, k, v, g, beta`` (:data:`RULE_TENSORS`).
    """
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    inputs = {name: call[name].to(dtype).clone().requires_grad_() for name in ("q", "k", "v")}
    inputs["g"] = call["g"].to(wide).clone().requires_grad_()
    inputs["beta"] = call["beta"].to(dtype).clone().requires_grad_()
    out = rule(*(inputs[name] for name in ("q", "k", "v", "g", "beta")))
    out = out[0] if isinstance(out, tuple) else out
    out.backward(call["do"].to(out.dtype))
    return {"out": out.detach().double(), **{n: t.grad.double() for n, t in inputs.items()}}


@contextlib.contextmanager
def record_gates(model: torch.nn.Module) -> Iterator[list[dict]]:
    """Record ``g``, ``dg`` and the gate inputs of every GatedDeltaNet layer of ``model``.

    Yields a list that gets one dict per layer call: ``g`` (float64, detached), ``dg`` (filled
    by the backward pass), ``layer`` (the module, for its ``A_log``/``dt_bias``), and the rule's
    other inputs ``q``, ``k``, ``v``, ``beta`` and its output gradient ``do`` (detached, in
    their dtypes), so that the rule can be run again on exactly what it got. The layers'
    ``gated_delta_rule`` is wrapped for the duration.
    """
    calls: list[dict] = []
    layers = [m for m in model.modules() if hasattr(m, "gated_delta_rule") and hasattr(m, "A_log")]
    originals = [layer.gated_delta_rule for layer in layers]

    def wrap(layer, rule):
        def recorded(q, k, v, g=None, beta=None, **kwargs):
            entry = {"layer": layer, "g": g.detach().double()}
            rule_inputs = dict(q=q, k=k, v=v, beta=beta)
            entry.update((name, t.detach().clone()) for name, t in rule_inputs.items())
            calls.append(entry)
            if g.requires_grad:
                g.register_hook(lambda grad: entry.__setitem__("dg", grad.detach().double()))
            out = rule(q, k, v, g=g, beta=beta, **kwargs)
            core = out[0] if isinstance(out, tuple) else out
            if core.requires_grad:
                core.register_hook(lambda grad: entry.__setitem__("do", grad.detach().clone()))
            return out

        return recorded

    for layer, rule in zip(layers, originals, strict=True):
        layer.gated_delta_rule = wrap(layer, rule)
    try:
        yield calls
    finally:
        for layer, rule in zip(layers, originals, strict=True):
            layer.gated_delta_rule = rule

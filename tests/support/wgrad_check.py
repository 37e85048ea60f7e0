"""How far a fused weight-gradient accumulation may be from the unfused one, per ``main_grad``.

``gradient_accumulation_fusion`` changes only where megatron's local linear layers add their
weight gradient ``sum_m G_m^T X_m`` (over micro-batches ``m``): into ``main_grad`` in the GEMM,
or rounded to the layer's dtype and added by DDP's hook. Everything else is the same arithmetic.
So a parameter that no megatron linear multiplies has the same ``main_grad`` bit for bit, and a
linear's weight differs by the roundings of the two paths: each within ``gamma_K sum |G|^T |X|``
of the exact products in float32 (``K`` the tokens of a micro-batch; Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., ch. 3), plus one rounding per add into
``main_grad`` and, for bf16 layers, the unfused gradient's rounding to bfloat16 (``2 ** -9``
relative). A tied output weight's embedding gradient is added in another order (at most
``|main_grad|`` plus the products). :func:`capture_products` records ``|X|`` and ``|G|`` of every
call with forward hooks; :func:`main_grad_ratios` divides each difference by that bound.
"""

from __future__ import annotations

import torch

U32 = 2.0**-24
U_BF16 = 2.0**-8


def keep_megatron_linears_module(monkeypatch) -> None:
    """Put megatron's ``tensor_parallel.layers`` weight-gradient kernels back as they were when
    the test ends (``install_wgrad_kernels`` and ``apply_gpu_fusions`` set them for the
    process)."""
    from megatron.core.tensor_parallel import layers

    from megatron_hybrid.modules.fast.wgrad import APEX_MODULE

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", layers._grad_accum_fusion_available)
    monkeypatch.setattr(layers, APEX_MODULE, getattr(layers, APEX_MODULE, None), raising=False)


def _megatron_linears(model) -> list:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    linears = (ColumnParallelLinear, RowParallelLinear)
    return [m for m in model.modules() if isinstance(m, linears)]


def capture_products(model) -> dict[int, list]:
    """``[|X|, |G|]`` (float64, ``[tokens, features]``) of every call of every megatron linear
    of ``model``, by the id of the weight it multiplies (a tied output layer multiplies the
    embedding's); ``G`` arrives in the backward."""
    calls: dict[int, list] = {}

    def hook(module, args, kwargs, output):
        weight = kwargs.get("weight")
        weight = module.weight if weight is None else weight
        record = [args[0].detach().reshape(-1, args[0].shape[-1]).abs().double(), None]
        calls.setdefault(id(weight), []).append(record)

        def keep(grad):
            record[1] = grad.detach().reshape(-1, grad.shape[-1]).abs().double()

        output[0].register_hook(keep)

    for module in _megatron_linears(model):
        module.register_forward_hook(hook, with_kwargs=True)
    return calls


def main_grad_ratios(
    fused: dict[str, torch.Tensor],
    unfused: dict[str, torch.Tensor],
    params: dict[str, torch.nn.Parameter],
    captured: dict[int, list],
    tokens: int,
    *,
    rounded_to_bf16: bool,
) -> dict[str, float]:
    """``max |fused - unfused| / bound`` per linear weight (at most 1 where the two paths agree);
    raises AssertionError where a parameter outside the linears differs at all.

    Args:
        fused, unfused: ``main_grad`` by parameter name, from the two paths.
        params: the fused model's parameters by name.
        captured: :func:`capture_products` of the fused model.
        tokens: ``K``, the longest weight-gradient dot product (tokens of a micro-batch).
        rounded_to_bf16: the unfused path rounds each weight gradient to bfloat16 (bf16
            layers) before DDP adds it.
    """
    ratios = {}
    for name, grad in fused.items():
        reference = unfused[name]
        if id(params[name]) not in captured:
            assert torch.equal(grad, reference), f"{name}: changed outside the linear layers"
            continue
        calls = captured[id(params[name])]
        products = sum(g.t() @ x for x, g in calls)
        bound = 2 * (tokens + 3) * U32 * products + 4 * U32 * reference.double().abs()
        if rounded_to_bf16:
            bound = bound + U_BF16 * (reference.double().abs() + products)
        error = (grad.double() - reference.double()).abs()
        ratios[name] = float((error / bound.clamp_min(1e-300)).max())
    return ratios

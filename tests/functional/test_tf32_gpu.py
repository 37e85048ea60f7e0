"""The TF32 batched product (``kernels/tf32.py``), which the fast path's Mamba2 scan runs on CUDA,
at the scan's shapes for ``benchmarks/mfu.py``'s issue (64 heads of 64 in 8 groups, state 128,
chunks of 128, 4,096 tokens): forward and both gradients against float64, with the process's
TF32 flag off, and the flag as it was afterwards; the times against float32 products.

Bound, per element: each operand rounded to TF32 (10 stored mantissa bits; truncation or
rounding, ``|delta| <= 2^-10``) gives a product within ``(2^-9 + 2^-20) |a| |b|``, and float32
accumulation of ``K`` terms adds ``K 2^-24`` of ``sum |a| |b|``. Control: a product that pairs
the wrong terms (``b`` reversed along ``K``) breaks the bound.

That TF32 ran, not float32, in the forward and in both products of the backward (which autograd
runs on its own thread): the float32 products (``torch.bmm`` with TF32 off) are at least 8 times
nearer float64 (the float32 accumulation bound alone cannot tell the two apart at ``K = 8,192``).
This runs in a child process without ``NVIDIA_TF32_OVERRIDE``, which ``test_hf_gpu.py`` and
``test_rl_gpu.py`` set for every process of the suite (cuBLAS then computes no TF32 at all).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import exact_float32, gpu_time_us, report

#: In a child process: the largest errors against float64 of the operator's product and its two
#: gradients, and of the same three computed by float32 ``torch.bmm``, with the flag off.
_CHILD = """
import json, torch
from megatron_hybrid.kernels.tf32 import tf32_bmm
gen = torch.Generator(device="cuda").manual_seed(7)
a, b, g = (torch.randn(64, 128, 128, device="cuda", generator=gen) for _ in range(3))
torch.backends.cuda.matmul.fp32_precision = "ieee"
exact = [x.double() @ y.double() for x, y in ((a, b), (g, b.mT), (a.mT, g))]
def errors(product):
    x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = product(x, y)
    got = [out, *torch.autograd.grad(out, (x, y), g)]
    return [float((t.detach().double() - e).abs().max()) for t, e in zip(got, exact)]
print(json.dumps([errors(tf32_bmm), errors(torch.bmm)]))
"""


def test_operator_takes_tf32_forward_and_backward(world):
    _, _, device = world
    if device.type != "cuda":
        pytest.skip("TF32 products are CUDA's")
    env = {k: v for k, v in os.environ.items() if k != "NVIDIA_TF32_OVERRIDE"}
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    tf32, float32 = json.loads(done.stdout.strip().splitlines()[-1])
    names = ("out", "grad a", "grad b")
    rows = [(n, f"{t:.3g}", f"{f:.3g}") for n, t, f in zip(names, tf32, float32, strict=True)]
    report("TF32 ran (child process without NVIDIA_TF32_OVERRIDE), 64 x 128 x 128 @ 128 x 128",
           [("max error", "TF32 operator", "float32 bmm"), *rows])  # fmt: skip
    assert all(t >= 8 * f for t, f in zip(tf32, float32, strict=True)), (tf32, float32)


# batch, M, K, N: the chunk products ([b c g] x [128, 128] @ [128, r p]), and the sum over
# 8,192 = P x N of the states-between product's backward.
SHAPES = [
    pytest.param((256, 128, 128, 512), id="chunk-products"),
    pytest.param((64, 33, 8192, 33), id="long-sum"),
]


def _worst(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """``max |got - a b| / bound`` for the TF32 bound and the float32 accumulation bound alone
    (``a b`` in float64)."""
    exact = a.double() @ b.double()
    magnitude = a.double().abs() @ b.double().abs()
    error = (got.double() - exact).abs()
    accumulation = a.shape[-1] * 2.0**-24 * magnitude
    tf32 = (2.0**-9 + 2.0**-20) * magnitude + accumulation
    tiny = 1e-300
    return (
        float((error / tf32.clamp(min=tiny)).max()),
        float((error / accumulation.clamp(min=tiny)).max()),
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_tf32_products_within_bound_and_flag_untouched(world, shape):
    from megatron_hybrid.kernels.tf32 import tf32_bmm

    _, _, device = world
    if device.type != "cuda":
        pytest.skip("TF32 products are CUDA's")
    batch, m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(7)
    a = torch.randn(batch, m, k, device=device, generator=gen).requires_grad_()
    b = torch.randn(batch, k, n, device=device, generator=gen).requires_grad_()
    grad = torch.randn(batch, m, n, device=device, generator=gen)
    settings = torch.backends.cuda.matmul
    with exact_float32():  # the process's flag off: the operator turns TF32 on by itself
        out = tf32_bmm(a, b)
        grad_a, grad_b = torch.autograd.grad(out, (a, b), grad)
        flag_after = settings.fp32_precision, settings.allow_tf32
        ieee = torch.bmm(a.detach(), b.detach())
        ieee_us = gpu_time_us(lambda: torch.bmm(a.detach(), b.detach()), 10)
        tf32_us = gpu_time_us(lambda: tf32_bmm(a.detach(), b.detach()), 10)
    a, b = a.detach(), b.detach()
    checks = {
        "out": _worst(out, a, b),
        "grad a": _worst(grad_a, grad, b.transpose(1, 2)),
        "grad b": _worst(grad_b, a.transpose(1, 2), grad),
    }
    float32 = _worst(ieee, a, b)
    with exact_float32():
        paired_wrong = _worst(tf32_bmm(a, b.flip(1)), a, b)
    report(f"TF32 batched product {shape}", [("", "error / TF32 bound", "error / float32 bound")]
           + [(name, f"{t:.3g}", f"{f:.3g}") for name, (t, f) in checks.items()]
           + [("float32 products", f"{float32[0]:.3g}", f"{float32[1]:.3g}"),
              ("control: b reversed along K", f"{paired_wrong[0]:.3g}", ""),
              ("µs, TF32 / float32", f"{tf32_us:.0f}", f"{ieee_us:.0f}")])  # fmt: skip
    assert flag_after == ("ieee", False), flag_after
    assert all(tf32 <= 1 for tf32, _ in checks.values()), checks
    assert paired_wrong[0] > 1, paired_wrong

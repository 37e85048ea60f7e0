"""The TF32 batched product (``kernels/tf32.py``), which the fast path's Mamba2 scan runs on CUDA,
at the scan's shapes for ``benchmarks/mfu.py``'s issue (64 heads of 64 in 8 groups, state 128,
chunks of 128, 4,096 tokens): forward and both gradients against float64, with the process's
TF32 flag off, and the flag as it was afterwards; the times against float32 products.

Bound, per element: each operand rounded to TF32 (10 stored mantissa bits; truncation or
rounding, ``|delta| <= 2^-10``) gives a product within ``(2^-9 + 2^-20) |a| |b|``, and float32
accumulation of ``K`` terms adds ``K 2^-24`` of ``sum |a| |b|``. Controls: a product that pairs
the wrong terms (``b`` reversed along ``K``) breaks the bound; and TF32 ran, not float32: the
float32 products (``torch.bmm`` with TF32 off) are at least 8 times nearer float64 (at
``K = 8,192`` the float32 accumulation bound alone no longer tells the two apart, so the control
compares errors). ``test_hf_gpu.py`` and ``test_rl_gpu.py`` set ``NVIDIA_TF32_OVERRIDE=0`` for
the whole process when they are collected (cuBLAS then runs no TF32 at all); in such a process
the last control runs in a child process without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import exact_float32, gpu_time_us, report

#: In a child process: the largest error against float64 of the operator's product and of
#: float32 ``torch.bmm``, with the process's flag off.
_CHILD = """
import json, torch
from megatron_hybrid.kernels.tf32 import tf32_bmm
gen = torch.Generator(device="cuda").manual_seed(7)
a, b = (torch.randn(64, 128, 128, device="cuda", generator=gen) for _ in range(2))
torch.backends.cuda.matmul.fp32_precision = "ieee"
exact = a.double() @ b.double()
print(json.dumps([float((p.double() - exact).abs().max()) for p in (tf32_bmm(a, b), a @ b)]))
"""


def _errors_without_override() -> tuple[float, float]:
    """:data:`_CHILD`'s two errors, measured where ``NVIDIA_TF32_OVERRIDE`` is not set."""
    env = {k: v for k, v in os.environ.items() if k != "NVIDIA_TF32_OVERRIDE"}
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    tf32, float32 = json.loads(done.stdout.strip().splitlines()[-1])
    return tf32, float32


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
           + [("control: float32 products", f"{float32[0]:.3g}", f"{float32[1]:.3g}"),
              ("control: b reversed along K", f"{paired_wrong[0]:.3g}", ""),
              ("µs, TF32 / float32", f"{tf32_us:.0f}", f"{ieee_us:.0f}")])  # fmt: skip
    assert flag_after == ("ieee", False), flag_after
    assert all(tf32 <= 1 for tf32, _ in checks.values()), checks
    assert paired_wrong[0] > 1, paired_wrong
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        tf32_error, float32_error = _errors_without_override()
        report(
            "TF32 ran (child process without NVIDIA_TF32_OVERRIDE)",
            [("max error, TF32 / float32", f"{tf32_error:.3g}", f"{float32_error:.3g}")],
        )
        assert tf32_error >= 8 * float32_error, (tf32_error, float32_error, "TF32 did not run?")
    else:
        assert checks["out"][1] >= 8 * float32[1], (checks["out"], float32, "TF32 did not run?")

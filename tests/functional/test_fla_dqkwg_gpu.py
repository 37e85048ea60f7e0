"""The package's gated ``chunk_bwd_dqkwg`` on a GPU, the piece of fla's GatedDeltaNet backward
that fla refuses on Hopper with Triton 3.4-3.7.0 (fla #640).

    torchrun --nproc_per_node 1 -m pytest -q -s tests/functional/test_fla_dqkwg_gpu.py

On the inputs fla's backward passes it in training (bf16 ``q, k, v, do, h, dh, dv``, float32
``g``; the benchmark's 16 value heads of 128 and a small GQA case), ``dq, dk, dw, dg`` must be
within the float32 accumulation bound plus two bf16 roundings (the kernel's cast of ``ds`` before
its second product and of its outputs) of the float64 oracle
(``support.dqkwg_reference``). Where fla runs its own kernel (not Hopper with
Triton 3.4-3.7.0), that one is held to the same bound and both are timed: the table is the
yardstick of the package's kernel against fla's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import report

# (batch, tokens, key heads, value heads, K = V)
SHAPES = {"benchmark": (1, 4096, 16, 16, 128), "gqa": (2, 300, 2, 4, 64)}


def _inputs(batch, tokens, heads, value_heads, dim, device):
    gen = torch.Generator().manual_seed(3)
    chunks = batch * -(-tokens // 64)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, torch.bfloat16)

    steps = -0.3 * torch.rand(batch, tokens, value_heads, generator=gen)
    g = torch.cat([c.cumsum(1) for c in steps.split(64, dim=1)], 1).to(device)
    return dict(q=r(batch, tokens, heads, dim), k=r(batch, tokens, heads, dim, scale=dim**-0.5),
                v=r(batch, tokens, value_heads, dim), do=r(batch, tokens, value_heads, dim),
                h=r(chunks, value_heads, dim, dim), dh=r(chunks, value_heads, dim, dim),
                w=r(batch, tokens, value_heads, dim), dv=r(batch, tokens, value_heads, dim),
                g=g, scale=dim**-0.5, chunk_size=64)  # fmt: skip


def _timed(fn, args) -> tuple[tuple, float]:
    out = fn(**args)  # compiles and autotunes
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        fn(**args)
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end) / 10


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_dqkwg_within_the_bf16_bound_and_against_fla(world, shape):
    from support.dqkwg_reference import (
        dqkwg_bound,
        dqkwg_magnitudes,
        dqkwg_reference,
    )

    from megatron_hybrid.modules.fla_backend import dqkwg_choice
    from megatron_hybrid.modules.fla_dqkwg import chunk_bwd_dqkwg

    if not torch.cuda.is_available():
        pytest.skip("Triton kernels need a GPU")
    pytest.importorskip("fla")
    *_, device = world
    batch, tokens, heads, value_heads, dim = shape
    args = _inputs(batch, tokens, heads, value_heads, dim, device)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in args.items()}
    exact, magnitudes = dqkwg_reference(**cpu), dqkwg_magnitudes(**cpu)
    # float32 accumulation, plus ds and the outputs rounded to bf16 (2^-9 each)
    bound = [
        b + 2.0**-8 * m
        for b, m in zip(dqkwg_bound(dim, dim, 64, magnitudes), magnitudes, strict=True)
    ]
    kernels = {"package": chunk_bwd_dqkwg}
    choice, why = dqkwg_choice()
    if choice == "fla":  # fla runs its own kernel here: the yardstick
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg as fla_dqkwg

        kernels["fla"] = fla_dqkwg
    rows, failures = [("kernel", "dq", "dk", "dw", "dg", "ms")], []
    for name, fn in kernels.items():
        out, ms = _timed(fn, args)
        ratios = [
            float(((o.double().cpu() - e).abs() / b).max())
            for o, e, b in zip(out, exact, bound, strict=True)
        ]
        rows.append((name, *(f"{r:.2e}" for r in ratios), f"{ms:.3f}"))
        failures += [f"{name}: {ratios}"] if max(ratios) > 1 else []
    rows.append((f"dqkwg choice here: {choice} ({why})",))
    report(f"chunk_bwd_dqkwg error / bound, B{batch} T{tokens} H{heads}/{value_heads} K=V{dim}",
           rows)  # fmt: skip
    assert not failures, failures

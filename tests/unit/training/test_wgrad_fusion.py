"""``gradient_accumulation_fusion`` with the package's weight-gradient kernels (CPU, gloo).

``train`` turns megatron-core's fusion on for its local linear layers on GPUs and hands them
``modules/fast/wgrad.py``'s kernels where apex's are missing: each linear adds
``grad_output^T @ input`` into its weight's ``main_grad`` and DDP's hook adds nothing. The
gradients must be those of the unfused path: every ``main_grad`` within float32 rounding of it
(the bound from the layers' own inputs and output gradients, captured by hooks), every
parameter outside a linear bitwise equal, over two micro-batches, with tied and untied output
weights, megatron's reference modules and the fast path. Controls: kernels that overwrite
instead of adding, and a tied output weight whose placeholder gradient is not zeroed (the
embedding's own gradient is then lost).
"""

from __future__ import annotations

import pytest
import torch
from support.wgrad_check import capture_products, keep_megatron_linears_module, main_grad_ratios

PATTERN = "[*E]{2}"
U = 2.0**-24
TOKENS = 2 * 16  # rows x sequence: the length of every weight-gradient dot product


@pytest.fixture
def wgrad_kernels(monkeypatch):
    """:func:`install_wgrad_kernels` for one test; megatron's module as it was afterwards."""
    from megatron.core.tensor_parallel import layers

    from megatron_hybrid.modules.fast import wgrad

    keep_megatron_linears_module(monkeypatch)
    assert wgrad.install_wgrad_kernels() == "torch"
    return layers


def _chunk(pg, *, fused: bool, tied: bool, fast: bool):
    from megatron_hybrid.modules import hybrid_stack_spec
    from megatron_hybrid.testing.models import small_config
    from megatron_hybrid.training.loop import build_model_chunks

    config = small_config(PATTERN, num_moe_experts=4, gradient_accumulation_fusion=fused)
    spec = hybrid_stack_spec("local", config=config, local_impl="fast") if fast else None
    torch.manual_seed(5)
    (chunk,) = build_model_chunks(
        config, PATTERN, pg, backend="local", vocab_size=128, max_sequence_length=16,
        share_embeddings_and_output_weights=tied, stack_spec=spec,
    )  # fmt: skip
    return chunk


def _steps(chunk) -> dict[str, torch.Tensor]:
    """Two micro-batches' forward and backward, DDP's gradient sync; every ``main_grad``."""
    from megatron_hybrid.testing.models import model_inputs

    chunk.zero_grad_buffer()
    for seed in (1, 2):
        inputs = model_inputs(batch=2, seq=16, vocab=128, seed=seed)
        logits = chunk(**inputs)
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
        (logits.float() * weights).sum().backward()
    chunk.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in chunk.module.named_parameters()}


def _overwrite(total_input, grad_output, main_grad):
    main_grad.copy_(grad_output.t().float() @ total_input.float())


CASES = [
    pytest.param(True, False, None, True, id="tied-reference"),
    pytest.param(False, False, None, True, id="untied-reference"),
    pytest.param(True, True, None, True, id="tied-fast"),
    pytest.param(True, False, "overwrite", False, id="control-overwrite"),
    pytest.param(True, False, "unzeroed-placeholder", False, id="control-unzeroed-placeholder"),
]


@pytest.mark.parametrize(("tied", "fast", "control", "within"), CASES)
def test_fused_main_grads_are_the_unfused_ones(pg, wgrad_kernels, monkeypatch, tied, fast,
                                               control, within):  # fmt: skip
    from megatron_hybrid.modules.fast import wgrad

    calls = []
    kernel = _overwrite if control == "overwrite" else wgrad.wgrad_gemm_accum_fp32
    monkeypatch.setattr(wgrad.WGRAD_KERNELS, "wgrad_gemm_accum_fp32",
                        lambda *a: (calls.append(a[2].shape), kernel(*a)))  # fmt: skip

    unfused = _steps(_chunk(pg, fused=False, tied=tied, fast=fast))
    assert calls == []
    chunk = _chunk(pg, fused=True, tied=tied, fast=fast)
    if control == "unzeroed-placeholder":
        del chunk.module.shared_embedding_or_output_weight().zero_out_wgrad
    captured = capture_products(chunk.module)
    fused = _steps(chunk)

    named = dict(chunk.module.named_parameters())
    assert len(calls) == 2 * len(captured) > 0  # one fused add per linear and micro-batch
    assert all(named[n].grad_added_to_main_grad for n in named if id(named[n]) in captured)
    ratios = main_grad_ratios(fused, unfused, named, captured, TOKENS, rounded_to_bf16=False)
    assert ratios and (max(ratios.values()) <= 1) == within, ratios


def test_kernels_add_in_place_in_float32(wgrad_kernels):
    from megatron_hybrid.modules.fast.wgrad import WGRAD_KERNELS

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(24, 8, generator=generator).bfloat16()
    g = torch.randn(24, 6, generator=generator).bfloat16()
    main = torch.randn(6, 8, generator=generator)
    before, address = main.clone(), main.data_ptr()
    WGRAD_KERNELS.wgrad_gemm_accum_fp32(x, g, main)
    exact = before.double() + g.double().t() @ x.double()
    bound = (24 + 1) * U * (before.double().abs() + g.double().abs().t() @ x.double().abs())
    assert main.data_ptr() == address and main.dtype == torch.float32
    assert bool(((main.double() - exact).abs() <= bound).all())
    half = torch.zeros(6, 8, dtype=torch.bfloat16)
    WGRAD_KERNELS.wgrad_gemm_accum_fp16(x, g, half)
    torch.testing.assert_close(half, (g.float().t() @ x.float()).bfloat16())


def test_megatron_calls_the_installed_kernels(wgrad_kernels):
    from megatron_hybrid.modules.fast.wgrad import APEX_MODULE, WGRAD_KERNELS, install_wgrad_kernels

    assert getattr(wgrad_kernels, APEX_MODULE) is WGRAD_KERNELS
    assert wgrad_kernels._grad_accum_fusion_available
    assert install_wgrad_kernels() == "torch"  # idempotent


def test_a_torch_without_float32_output_gemm_is_refused(monkeypatch):
    from megatron.core.tensor_parallel import layers

    from megatron_hybrid.modules.fast import wgrad

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(layers, wgrad.APEX_MODULE, None, raising=False)

    class _Addmm:
        @staticmethod
        def overloads():
            return ["default", "out"]

    monkeypatch.setattr(torch.ops.aten, "addmm", _Addmm, raising=False)
    assert "torch >= 2.8" in wgrad.wgrad_kernels_reason()
    with pytest.raises(RuntimeError, match="gradient_accumulation_fusion: torch .* no addmm"):
        wgrad.install_wgrad_kernels()

"""train's GPU defaults for megatron's fused SwiGLU, cross-entropy and weight-gradient accumulation:
where they apply (``test_wgrad_fusion.py`` checks the last one's gradients), and that
they compute what the unfused modules compute (on the CPU, where the fused functions run
eagerly): the cross-entropy bitwise for bf16 logits, SwiGLU (plain and with the routing weight)
within float32 rounding of float64, forward and backward. Negative controls: the fused
cross-entropy's gradient on float32 logits (why it needs bf16), the fused GELU (the tanh
approximation, why only SwiGLU is fused), a SwiGLU with its halves swapped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from support.wgrad_check import keep_megatron_linears_module

from megatron_hybrid.training.fusions import apply_gpu_fusions, fusion_reasons

U = 2.0**-24
MODEL = ("--num-experts", "4", "--hidden-size", "16", "--num-attention-heads", "2")


@pytest.fixture(autouse=True)
def _megatron_linears_restored(monkeypatch):
    """``apply_gpu_fusions`` hands megatron's linear layers the weight-gradient kernels; each
    test leaves megatron's module as it was."""
    keep_megatron_linears_module(monkeypatch)


def _config(*flags, **overrides):
    from megatron_hybrid.training.config import config_from_flags

    return config_from_flags("[*E]", *MODEL, *flags, **overrides)


@pytest.mark.parametrize(
    ("flags", "overrides", "expected"),
    [
        pytest.param(("--swiglu", "--bf16"), {}, {}, id="swiglu-bf16-both"),
        pytest.param(("--bf16",), {}, {"bias_activation_fusion": "not SwiGLU"}, id="gelu"),
        pytest.param(("--swiglu",), {}, {"cross_entropy_loss_fusion": "not bf16"}, id="fp32"),
        pytest.param(("--swiglu", "--bf16"), {"activation_func_clamp_value": 7.0},
                     {"bias_activation_fusion": "clamps its inputs"}, id="clamped-glu"),
        pytest.param(("--swiglu", "--bf16"), {"transformer_impl": "transformer_engine"},
                     {"gradient_accumulation_fusion": "fuse_wgrad_accumulation"}, id="te"),
        pytest.param(("--swiglu", "--bf16", "--no-gradient-accumulation-fusion"), {},
                     {"gradient_accumulation_fusion": "--no-gradient-accumulation-fusion"},
                     id="wgrad-off"),
    ],
)  # fmt: skip
def test_which_fusions_apply(flags, overrides, expected):
    config = _config(*flags, **overrides)
    off = "--no-gradient-accumulation-fusion" in flags
    reasons = apply_gpu_fusions(config, gradient_accumulation_fusion=not off)
    for field, reason in reasons.items():
        if field in expected:
            assert reason is not None and expected[field].split()[-1] in reason
            assert getattr(config, field) is False
        else:
            assert reason is None and getattr(config, field) is True
    if "cross_entropy_loss_fusion" not in expected:
        assert config.cross_entropy_fusion_impl == "native"


def test_train_turns_them_on_on_gpus_only():
    import argparse

    from megatron_hybrid.runtime import RuntimeBackend
    from megatron_hybrid.training import run
    from megatron_hybrid.training.arguments import add_hybrid_args
    from megatron_hybrid.training.run import model_config
    from megatron_hybrid.training.train_settings import settings_from_args

    parser = argparse.ArgumentParser()
    add_hybrid_args(parser)
    args = parser.parse_args(["--hybrid-layer-pattern", "[*E]", *MODEL, "--swiglu", "--bf16"])
    args = settings_from_args(args)
    gpu = model_config(args, None, RuntimeBackend("cuda"))
    cpu = model_config(args, None, RuntimeBackend("cpu"))
    assert gpu.bias_activation_fusion and gpu.cross_entropy_loss_fusion
    assert not (cpu.bias_activation_fusion or cpu.cross_entropy_loss_fusion)
    assert fusion_reasons(cpu) == {
        "bias_activation_fusion": None,
        "cross_entropy_loss_fusion": None,
        "gradient_accumulation_fusion": None,
    }
    assert run.apply_gpu_fusions is apply_gpu_fusions


def _cross_entropy(fused: bool, logits, labels, group):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    leaf = logits.clone().requires_grad_()
    x = leaf * 1  # the losses change their input in place, as they do the output layer's
    if fused:
        loss = fused_vocab_parallel_cross_entropy(x, labels, group)
    else:
        loss = vocab_parallel_cross_entropy(x, labels, tp_group=group)
    (grad,) = torch.autograd.grad((loss * torch.linspace(0.5, 2, loss.numel()).view_as(loss)).sum(),
                                  leaf)  # fmt: skip
    return loss, grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "control-fp32"])
def test_fused_cross_entropy_is_the_unfused_one_for_bf16_logits(pg, dtype):
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(9, 2, 64, generator=generator)).to(dtype)
    labels = torch.randint(0, 64, (9, 2), generator=generator)
    fused = _cross_entropy(True, logits, labels, pg.tp)
    unfused = _cross_entropy(False, logits, labels, pg.tp)
    assert torch.equal(fused[0], unfused[0])
    # bf16: bitwise; float32 (the control): the fused backward rounds the gradient to bf16.
    assert torch.equal(fused[1], unfused[1]) == (dtype == torch.bfloat16)


def _swiglu64(y, weights, grad):
    """SwiGLU (with the routing weight) in float64: output, input and weight gradients."""
    y = y.double().requires_grad_()
    w = None if weights is None else weights.double().requires_grad_()
    a, b = y.chunk(2, -1)
    out = F.silu(a) * b * (1 if w is None else w)
    grads = torch.autograd.grad(out, [y] if w is None else [y, w], grad.double())
    return out.detach(), grads


def _bounds(y, weights, grad):
    """First-order float32 error bounds of SwiGLU's output and gradients, from float64 values:
    sigmoid (exp to 1 ulp, an add, a division) 4u; silu 5u; the product 6u (7u weighted); the
    derivative ``sigma (1 + a (1 - sigma))``: ``1 - sigma`` off by 4u absolutely, so
    ``|a| 5u + u (1 + |a| (1 - sigma))`` on the bracket, plus the products' roundings; the weight's
    gradient a float32 sum over the hidden width (gamma_n)."""
    y, g = y.double(), grad.double()
    a, b = y.chunk(2, -1)
    s = torch.sigmoid(a)
    w = 1.0 if weights is None else weights.double().abs()
    bracket = 1 + a.abs() * (1 - s)
    out = 7 * U * (F.silu(a) * b).abs() * w
    da = U * (g.abs() * w * s * b.abs()) * (5 * a.abs() + 9 * bracket)
    db = 7 * U * (g.abs() * w * F.silu(a)).abs()
    bounds = [out, torch.cat([da, db], -1)]
    if weights is not None:
        n = b.shape[-1]
        terms = (F.silu(a) * b * g).abs()
        bounds.append((n * U / (1 - n * U) + 7 * U) * terms.sum(-1, keepdim=True))
    return bounds


def _swiglu(kind: str, y, weights, grad):
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl

    y = y.clone().requires_grad_()
    w = None if weights is None else weights.clone().requires_grad_()
    if kind == "fused":
        out = (bias_swiglu_impl(y, None, False, False) if w is None
               else weighted_bias_swiglu_impl(y, None, w, False))  # fmt: skip
    elif kind == "unfused":  # megatron's MLP / the grouped experts without the fusion
        a, b = y.chunk(2, -1)
        out = F.silu(a) * b if w is None else ((F.silu(a) * b) * w).to(y.dtype)
    elif kind == "swapped-halves":
        out = bias_swiglu_impl(torch.cat(y.chunk(2, -1)[::-1], -1), None, False, False)
    elif kind == "fused-gelu":  # what bias_activation_fusion does to a GELU MLP
        a, b = y.chunk(2, -1)
        out = torch.cat([bias_gelu_impl(a, torch.zeros(a.shape[-1])), b], -1)[..., : b.shape[-1]]
        out = out * b
    grads = torch.autograd.grad(out, [y] if w is None else [y, w], grad)
    return out.detach(), grads


CASES = [
    pytest.param(False, "fused", True, id="mlp-fused"),
    pytest.param(False, "unfused", True, id="mlp-unfused"),
    pytest.param(True, "fused", True, id="experts-weighted-fused"),
    pytest.param(True, "unfused", True, id="experts-weighted-unfused"),
    pytest.param(False, "swapped-halves", False, id="control-swapped-halves"),
    pytest.param(False, "fused-gelu", False, id="control-fused-gelu"),
]


@pytest.mark.parametrize(("weighted", "kind", "within"), CASES)
def test_swiglu_fusion_within_float32_rounding_of_float64(megatron_cpu, weighted, kind, within):
    generator = torch.Generator().manual_seed(1)
    y = 4 * torch.randn(64, 2 * 48, generator=generator)
    grad = torch.randn(64, 48, generator=generator)
    weights = torch.rand(64, 1, generator=generator) if weighted else None
    out, grads = _swiglu(kind, y, weights, grad)
    exact_out, exact_grads = _swiglu64(y, weights, grad)
    bounds = _bounds(y, weights, grad)
    errors = [(out.double() - exact_out).abs()] + [
        (g.double() - e).abs() for g, e in zip(grads, exact_grads, strict=True)
    ]
    ratios = [float((e / b.clamp_min(1e-300)).max()) for e, b in zip(errors, bounds, strict=True)]
    assert all(r <= 1 for r in ratios) == within, ratios

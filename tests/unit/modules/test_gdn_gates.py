"""GatedDeltaNet's gate gradients (``A_log``, ``dt_bias``) against a float64 reference.

The float64 step-by-step recurrence is the truth. Every float32 path (the recurrence, megatron's
torch chunked rule, the CPU stand-in of fla's kernel and, under Triton's CPU interpreter, fla's
kernel itself) must be *consistent*: its gate-gradient errors within the Cauchy-Schwarz bound of
the ``dg`` and ``g`` it had (``support.gdn_gates``), and its ``dg`` within float32
precision of the chunked algorithm. The inputs have cancelling gate sums (amplification in the
hundreds), as small models have. Controls: a gate whose backward is wrong, and a kernel whose
``dg`` is off, are both reported as defects. Also: the package's GatedDeltaNet takes ``exp`` of
``A_log`` in float32 in a bf16 model (megatron-core's rounds it to bf16).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support import TESTS_DIR
from support.gdn_gates import gate_gradients, gate_report, gate_weights
from support.gdn_reference import recurrent_gated_delta_rule
from torch.nn.functional import normalize, softplus

from megatron_hybrid.modules import gdn_torch

# dg of the chunked float32 rules: ~2e-5 at these decays (cumulative log decays of hundreds
# within a chunk, exp of their float32 differences); a wrong gradient is off by O(1).
DG_FP32 = 1e-3


def gate_inputs(batch=2, seq=128, heads=4, dim=16, seed=0) -> tuple[dict, torch.Tensor]:
    """Inputs as the layer makes them, ``A`` in [1, 16] (megatron's init), and ``grad_out``."""
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(
        q=normalize(torch.randn(batch, seq, heads, dim, generator=gen), dim=-1),
        k=normalize(torch.randn(batch, seq, heads, dim, generator=gen), dim=-1),
        v=torch.randn(batch, seq, heads, dim, generator=gen),
        beta=torch.sigmoid(torch.randn(batch, seq, heads, generator=gen)),
        alpha=torch.randn(batch, seq, heads, generator=gen),
        A_log=torch.empty(heads).uniform_(1, 16, generator=gen).log(),
        dt_bias=1 + 0.1 * torch.randn(heads, generator=gen),
    )
    return inputs, torch.randn(batch, seq, heads, dim, generator=gen)


def _recurrent64(q, k, v, g, beta):
    return recurrent_gated_delta_rule(q, k, v, g, beta, compute_dtype=torch.float64)


def _megatron_torch(q, k, v, g, beta):
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule(q, k, v, g, beta)


RULES = {
    "recurrence": recurrent_gated_delta_rule,
    "megatron-torch": _megatron_torch,
    "stand-in": lambda q, k, v, g, beta: gdn_torch.chunk_gated_delta_rule(q, k, v, g, beta),
}


def _report(run, reference, a_log, rounding=0.0, dg_bound=None):
    return gate_report(
        run,
        reference,
        gate_weights(run["g"], a_log),
        gate_weights(reference["g"], a_log),
        rounding=rounding,
        dg_bound=dg_bound,
    )


@pytest.fixture(scope="module")
def truth():
    inputs, grad_out = gate_inputs()
    return inputs, grad_out, gate_gradients(_recurrent64, inputs, grad_out, torch.float64)


@pytest.mark.parametrize("name", list(RULES))
def test_float32_paths_are_consistent_with_float64(truth, name):
    inputs, grad_out, reference = truth
    run = gate_gradients(RULES[name], inputs, grad_out, torch.float32)
    report = _report(run, reference, inputs["A_log"], dg_bound=DG_FP32)
    assert report.verdict == "consistent", report
    assert max(report.kappa_a_log) > 50  # the sums cancel: a small dg error shows large


def test_bf16_gate_errors_are_amplified_dg_errors(truth):
    """bf16 inputs and parameters; the reference sees the same rounded values, in float64."""
    inputs, grad_out, _ = truth
    rounded = {name: t.bfloat16().double() for name, t in inputs.items()}
    reference = gate_gradients(_recurrent64, rounded, grad_out.bfloat16(), torch.float64)
    run = gate_gradients(_megatron_torch, inputs, grad_out, torch.bfloat16)
    weights = gate_weights(run["g"], rounded["A_log"])
    # The torch path computes in float32 and rounds its bf16 output once: dg is near exact.
    report = gate_report(run, reference, weights, gate_weights(reference["g"], rounded["A_log"]),
                         rounding=2**-7, dg_bound=1e-2)  # fmt: skip
    assert report.verdict == "consistent", report
    grads = reference["dA_log"].abs().tolist()
    relative = [e / g for e, g in zip(report.error_a_log, grads, strict=True)]
    assert max(relative) > 10 * report.dg_error  # what looks like a broken gradient is not


def test_control_wrong_gate_derivative_is_a_defect(truth):
    """The forward right, the softplus derivative taken as 1: dg is fine, dt_bias's is not."""
    inputs, grad_out, reference = truth

    class WrongSoftplus(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return softplus(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def gate(a_log, dt_bias, alpha):
        return -a_log.exp() * WrongSoftplus.apply(alpha + dt_bias)

    run = gate_gradients(_megatron_torch, inputs, grad_out, torch.float32, gate=gate)
    report = _report(run, reference, inputs["A_log"], dg_bound=DG_FP32)
    assert report.verdict.startswith("defect") and "dt_bias" in report.verdict, report
    assert "a_log" not in report.verdict


def test_control_wrong_kernel_dg_is_a_defect(truth):
    """A kernel whose dg is off by the factor ln 2 (an exp vs exp2 slip)."""
    inputs, grad_out, reference = truth

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, g):
            return g.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 0.6931

    def rule(q, k, v, g, beta):
        return _megatron_torch(q, k, v, Scaled.apply(g), beta)

    run = gate_gradients(rule, inputs, grad_out, torch.float32)
    report = _report(run, reference, inputs["A_log"], dg_bound=DG_FP32)
    assert report.verdict.startswith("defect") and "kernel dg" in report.verdict, report


def test_layer_decay_is_float32_in_a_bf16_model(pg):
    """exp(A_log) is taken in float32; megatron-core's own layer rounds it to bf16 (control)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_hybrid.testing.models import build_hybrid, small_config

    config = small_config("G", bf16=True, params_dtype=torch.bfloat16)
    layer = build_hybrid(config, "G", pg).decoder.layers[0].self_attention
    a_log = torch.tensor([0.3, 1.7], dtype=torch.bfloat16)  # exp not representable in bf16
    dt_bias = torch.tensor([1.0, 0.5], dtype=torch.bfloat16)
    alpha = torch.randn(1, 8, 2).bfloat16()
    want = -a_log.double().exp() * softplus(alpha.double() + dt_bias.double())
    ours, _ = layer._compute_g_and_beta(a_log, dt_bias, alpha, alpha)
    theirs, _ = GatedDeltaNet._compute_g_and_beta(layer, a_log, dt_bias, alpha, alpha)
    assert ours.dtype == torch.float32
    assert ((ours.double() - want).abs() / want.abs()).max() < 1e-6
    assert ((theirs.double() - want).abs() / want.abs()).max() > 1e-4


_FLA_UNDER_INTERPRETER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})  # tests/, for support
    from support.triton_interpreter import counting_ranges, one_autotune_config

    one_autotune_config()
    counting_ranges()

    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    sys.path.insert(0, {tests!r})
    from test_gdn_gates import DG_FP32, _recurrent64, _report, gate_inputs
    from support.gdn_gates import gate_gradients

    inputs, grad_out = gate_inputs()
    reference = gate_gradients(_recurrent64, inputs, grad_out, torch.float64)
    run = gate_gradients(lambda *t: chunk_gated_delta_rule(*t), inputs, grad_out, torch.float32)
    report = _report(run, reference, inputs["A_log"], dg_bound=DG_FP32)
    print("dg error", report.dg_error, "verdict", report.verdict)
    assert report.verdict == "consistent", report
    """)


@pytest.mark.slow
def test_fla_float32_gate_gradients_are_consistent_under_triton_interpreter(tmp_path):
    """fla's own Triton kernels, run on the CPU by Triton's interpreter, in float32."""
    pytest.importorskip("fla")
    pytest.importorskip("triton.runtime.interpreter")
    script = tmp_path / "fla_gates.py"
    script.write_text(
        _FLA_UNDER_INTERPRETER.format(tests=os.path.dirname(__file__), root=TESTS_DIR)
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verdict consistent" in done.stdout

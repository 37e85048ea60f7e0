"""The naive gated delta rule reference, and megatron's torch chunked path checked against it.

float32 on the CPU. The reference (``support.gdn_reference``) is checked first
against independently written math, then megatron-core's ``torch_chunk_gated_delta_rule`` (the
``deterministic_mode`` path of its GatedDeltaNet) against the reference: forward output and the
gradients of all five inputs.
"""

from __future__ import annotations

import pytest
import torch
from rounding import bounds_of, outside
from support.gdn_reference import (
    depthwise_causal_conv1d,
    make_gdn_inputs,
    recurrent_gated_delta_rule,
)
from torch.nn.functional import normalize, silu

from megatron_hybrid.testing.overlap import rel_error

NAMES = ("q", "k", "v", "g", "beta")

# The least relative error allowed (both sides float32, about 1e-7 apart norm-relative at these
# sizes); each result's bound is the reference's float32 rounding scale where that is larger. A
# wrong decay, scale, chunk boundary or gradient is off by far more than 1e-5.
FP32_REL_TOL = 1e-5


def _forward_backward(fn, inputs: dict, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """``fn``'s output and the gradients of its inputs for the upstream gradient ``grad_out``."""
    leaves = {name: inputs[name].detach().clone().requires_grad_() for name in NAMES}
    out = fn(**leaves)
    if isinstance(out, tuple):  # megatron's kernel returns (output, final_state)
        out = out[0]
    out.backward(grad_out)
    return {"o": out.detach(), **{f"d{name}": leaves[name].grad for name in NAMES}}


def _two_step_by_hand(q, k, v, g, beta, scale):
    """T = 2, one batch row and head, written out without a loop or a state matrix.

    Step 1 starts from S = 0, so S1 = beta1 k1 v1^T. Step 2 decays it, predicts
    exp(g2) beta1 (k1.k2) v1 for k2, and writes u2 = beta2 (v2 - that prediction) at k2.
    """
    (q1, q2), (k1, k2), (v1, v2), (g1, g2), (b1, b2) = q, k, v, g, beta
    del g1  # decays an all-zero state
    o1 = scale * b1 * (k1 @ q1) * v1
    u2 = b2 * (v2 - g2.exp() * b1 * (k1 @ k2) * v1)
    o2 = scale * (g2.exp() * b1 * (k1 @ q2) * v1 + (k2 @ q2) * u2)
    return torch.stack([o1, o2])


def test_reference_matches_two_steps_written_out():
    gen = torch.Generator().manual_seed(0)
    key_dim, value_dim, scale = 2, 3, 0.7
    tensors = dict(
        q=torch.randn(2, key_dim, generator=gen, dtype=torch.float64),
        k=normalize(torch.randn(2, key_dim, generator=gen, dtype=torch.float64), dim=-1),
        v=torch.randn(2, value_dim, generator=gen, dtype=torch.float64),
        g=-torch.rand(2, generator=gen, dtype=torch.float64) - 0.1,
        beta=torch.rand(2, generator=gen, dtype=torch.float64) * 0.8 + 0.1,
    )
    grad_out = torch.randn(2, value_dim, generator=gen, dtype=torch.float64)

    expected = _forward_backward(lambda **t: _two_step_by_hand(**t, scale=scale), tensors, grad_out)

    def reference(q, k, v, g, beta):
        # Add B = H = 1: [T, ...] -> [1, T, 1, ...].
        o = recurrent_gated_delta_rule(*(t[None, :, None] for t in (q, k, v, g, beta)), scale=scale)
        return o[0, :, 0]

    actual = _forward_backward(reference, tensors, grad_out)
    assert actual["o"].dtype == torch.float64  # returned in the input dtype
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_reference_recalls_the_last_value_written():
    """With beta = 1 and no decay, the delta rule stores v_t exactly at the unit key k_t.

    S^T k_t after the write is S^T k_t + (v_t - S^T k_t)(k_t . k_t) = v_t, so reading with
    q_t = k_t returns scale * v_t at every step, whatever was written before.
    """
    inputs = make_gdn_inputs(2, 40, 3, 8, 5, seed=1)
    inputs.update(q=inputs["k"], g=torch.zeros_like(inputs["g"]))
    inputs["beta"] = torch.ones_like(inputs["beta"])
    out = recurrent_gated_delta_rule(**inputs)
    torch.testing.assert_close(out, inputs["v"] * 8**-0.5, rtol=1e-4, atol=1e-5)


def test_reference_is_causal():
    inputs = make_gdn_inputs(1, 20, 2, 8, 8, seed=2)
    before = recurrent_gated_delta_rule(**inputs)
    changed = {name: t.clone() for name, t in inputs.items()}
    for name in NAMES:
        changed[name][:, 12:] = inputs[name][:, :8].flip(1)
    after = recurrent_gated_delta_rule(**changed)
    assert torch.equal(after[:, :12], before[:, :12])
    assert not torch.allclose(after[:, 12:], before[:, 12:])


# T = 50 is one partial chunk, 64 exactly one, 130 two full chunks and a partial one (megatron's
# path zero-pads the last chunk); K != V catches a transposed state.
@pytest.mark.parametrize(
    "batch,seq,heads,key_dim,value_dim",
    [(2, 50, 2, 16, 16), (2, 64, 2, 16, 16), (2, 130, 2, 16, 16), (2, 130, 2, 16, 32)],
    ids=["T50", "T64", "T130", "T130-V32"],
)
def test_megatron_torch_chunked_path_matches_reference(batch, seq, heads, key_dim, value_dim):
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    inputs = make_gdn_inputs(batch, seq, heads, key_dim, value_dim, seed=seq + value_dim)
    grad_out = torch.randn(batch, seq, heads, value_dim, generator=torch.Generator().manual_seed(7))

    reference = _forward_backward(recurrent_gated_delta_rule, inputs, grad_out)

    def megatron(**tensors):
        # As megatron's GatedDeltaNet calls it (q and k are already l2-normalised).
        return torch_chunk_gated_delta_rule(
            **tensors, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False
        )

    chunked = _forward_backward(megatron, inputs, grad_out)
    bounds = bounds_of(lambda: _forward_backward(recurrent_gated_delta_rule, inputs, grad_out),
                       measure=rel_error, floor=FP32_REL_TOL)  # fmt: skip
    over = outside(chunked, reference, bounds, rel_error)
    assert not over, over


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_conv_reference_matches_megatron_conv_layout(bias):
    """The reference equals the layer's deterministic path: nn.Conv1d padding W-1, then cut."""
    gen = torch.Generator().manual_seed(3)
    batch, seq, channels, width = 2, 17, 6, 4
    x = torch.randn(batch, seq, channels, generator=gen)
    conv = torch.nn.Conv1d(channels, channels, width, groups=channels, padding=width - 1, bias=bias)
    with torch.no_grad():
        expected = silu(conv(x.transpose(1, 2))[..., :seq]).transpose(1, 2)
    b = conv.bias if bias else None
    actual = depthwise_causal_conv1d(x, conv.weight.squeeze(1), b, activation="silu")
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    # Causal and by hand: step 0 sees only x[0] through the last tap.
    first = x[:, 0] * conv.weight[:, 0, -1] + (conv.bias if bias else 0)
    torch.testing.assert_close(actual[:, 0], silu(first).detach(), rtol=1e-6, atol=1e-6)

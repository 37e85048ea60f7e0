"""The exact WY inverse of a GatedDeltaNet chunk and the rounding bound of fla's block merge.

``support.wy_solve`` is what the GPU gate test holds fla's ``T`` to: the bound
must hold for an emulation of fla's blocking with IEEE and with TF32 (truncated) operands, must be
broken by TF32 operands when held to the IEEE bound (else it could not tell the two apart), and
must be broken by a wrong inverse (negative control). Inputs as the layer makes them: keys after
a SiLU and l2-normalisation (correlated), weak and strong decays.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.wy_solve import (
    check_solve,
    emulate_fla_solve,
    merge_error_bound,
    tf32_truncate,
    wy_inverse,
)
from torch.nn.functional import normalize, silu, softplus

TF32 = 2.0**-10
#: (id, the heads' A (decay rate), dt_bias): megatron's initial dt_bias (1) and A in [1, 16]
#: decay strongly; small A and dt_bias leave the 64 keys of a chunk nearly dependent.
REGIMES = [("strong", [4.0, 16.0], 1.0), ("weak", [0.02, 0.1], -4.0)]


def solve_inputs(a, dt_bias, batch=2, seq=128, dim=16, seed=0):
    """``k``, fla's chunk-local log2 cumsum of ``g``, and ``beta`` ``[B, T, H]``."""
    gen = torch.Generator().manual_seed(seed)
    heads = len(a)
    k = normalize(silu(0.5 + torch.randn(batch, seq, heads, dim, generator=gen)), dim=-1)
    beta = torch.sigmoid(torch.randn(batch, seq, heads, generator=gen))
    g = -torch.tensor(a) * softplus(torch.randn(batch, seq, heads, generator=gen) + dt_bias)
    g_cum = g.reshape(batch, -1, 64, heads).cumsum(2).reshape(batch, seq, heads) / math.log(2)
    return k, g_cum.float(), beta


@pytest.fixture(params=REGIMES, ids=[r[0] for r in REGIMES])
def inputs(request):
    _, a, dt_bias = request.param
    return solve_inputs(a, dt_bias)


def test_wy_inverse_inverts_i_plus_a(inputs):
    k, g_cum, beta = inputs
    t = wy_inverse(k, g_cum, beta)
    # Rebuild (I + A) directly from its definition, one chunk of one row and head.
    kc, gc, bc = k[0, 64:128, 1].double(), g_cum[0, 64:128, 1].double(), beta[0, 64:128, 1]
    a = (bc.double()[:, None] * (kc @ kc.T) * (gc[:, None] - gc[None, :]).exp2()).tril(-1)
    residual = (torch.eye(64, dtype=torch.float64) + a) @ t[0, 1, 1] - torch.eye(64)
    assert residual.abs().max() < 1e-12


def test_tf32_truncate_keeps_ten_mantissa_bits():
    x = torch.randn(1000, dtype=torch.float32) * 1e3
    y = tf32_truncate(x)
    relative = ((y - x) / x).abs()
    assert relative.max() < TF32 and relative.max() > TF32 / 4  # truncation, not rounding
    assert ((y - x) * x.sign() <= 0).all()  # toward zero
    assert torch.equal(tf32_truncate(y), y)


@pytest.mark.parametrize("rounding", ["ieee", "tf32"])
def test_emulated_fla_solve_is_within_its_bound(inputs, rounding):
    k, g_cum, beta = inputs
    truncate = tf32_truncate if rounding == "tf32" else (lambda x: x)
    t = emulate_fla_solve(k, g_cum, beta, round_operand=truncate)
    own = merge_error_bound(k, g_cum, beta, operand_roundoff=TF32 if rounding == "tf32" else 0.0)
    assert check_solve(t, k, g_cum, beta, own).error_over_bound <= 1


def test_tf32_operands_break_the_ieee_bound(inputs):
    """The bound tells TF32 from IEEE operands: TF32 lands far beyond the IEEE bound."""
    k, g_cum, beta = inputs
    t = emulate_fla_solve(k, g_cum, beta, round_operand=tf32_truncate)
    ieee = merge_error_bound(k, g_cum, beta, operand_roundoff=0.0)
    assert check_solve(t, k, g_cum, beta, ieee).error_over_bound > 10


def test_weak_decays_make_tf32_matter():
    """Where decays are weak, TF32 operands move T by about 2^-10 relative, not 2^-24."""
    k, g_cum, beta = solve_inputs(*REGIMES[1][1:])
    t = emulate_fla_solve(k, g_cum, beta, round_operand=tf32_truncate)
    check = check_solve(t, k, g_cum, beta, merge_error_bound(k, g_cum, beta, operand_roundoff=TF32))
    assert 1e-5 < check.relative_error < 1e-2
    assert check.growth > 0.3


def test_bf16_store_is_within_the_bound(inputs):
    """fla stores T in the keys' dtype: bf16 keys, a bf16 T."""
    k, g_cum, beta = inputs
    t = emulate_fla_solve(k.bfloat16().float(), g_cum, beta, round_operand=tf32_truncate)
    bound = merge_error_bound(k.bfloat16(), g_cum, beta, operand_roundoff=TF32,
                              store_roundoff=2.0**-8)  # fmt: skip
    assert check_solve(t.bfloat16(), k.bfloat16(), g_cum, beta, bound).error_over_bound <= 1


def test_control_an_inverse_missing_a_block_breaks_the_bound(inputs):
    k, g_cum, beta = inputs
    wrong = emulate_fla_solve(k, g_cum, beta, round_operand=tf32_truncate, drop_block=True)
    bound = merge_error_bound(k, g_cum, beta, operand_roundoff=TF32)
    assert check_solve(wrong, k, g_cum, beta, bound).error_over_bound > 10

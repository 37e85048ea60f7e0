"""RoPE in three kernels each way against megatron-core's unfused ``_apply_rotary_pos_emb_bshd``.

``apply_rope`` must give megatron's output and input gradient (float32 to rounding, bfloat16
within its rounding), with the whole head rotated or only part of it and with a YaRN-style
scale; its tables are built once per frequency tensor. ``FastSelfAttention`` leaves what it does
not cover to megatron with a reason. Negative control: the sine's sign flipped.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_hybrid.testing.overlap import rel_error


def _freqs(seq: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def _run(fn, t: torch.Tensor, grad: torch.Tensor):
    x = t.detach().clone().requires_grad_()
    out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad


CASES = [
    pytest.param(32, 1.0, id="full"),
    pytest.param(16, 1.0, id="partial"),
    pytest.param(32, 1.3, id="mscale"),
]


@pytest.mark.parametrize("rot, mscale", CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16"])  # fmt: skip
def test_rope_equals_megatrons(rot, mscale, dtype, tol):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_hybrid.modules.fast.rope import apply_rope

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(24, 2, 4, 32, generator=gen).to(dtype)
    grad = torch.randn(24, 2, 4, 32, generator=gen).to(dtype)
    freqs = _freqs(24, rot)
    ours = _run(lambda x: apply_rope(x, freqs, mscale), t, grad)
    theirs = _run(lambda x: _apply_rotary_pos_emb_bshd(x, freqs, mscale=mscale), t, grad)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and rel_error(a, b) < tol


def test_flipped_sine_is_caught():
    """Negative control: rotating the other way."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_hybrid.modules.fast import rope

    t, freqs = torch.randn(24, 2, 4, 32), _freqs(24, 32)
    cos, signed_sin = rope.rope_tables(freqs, t.dtype)
    wrong = rope._Rope.apply(t, cos, -signed_sin)
    assert rel_error(wrong, _apply_rotary_pos_emb_bshd(t, freqs)) > 0.1


def test_tables_are_built_once_per_frequency_tensor():
    from megatron_hybrid.modules.fast import rope

    freqs = _freqs(8, 16)
    first = rope.rope_tables(freqs, torch.float32)
    assert rope.rope_tables(freqs, torch.float32)[0] is first[0]
    freqs.mul_(2.0)  # modified in place: new tables
    assert rope.rope_tables(freqs, torch.float32)[0] is not first[0]
    key = id(freqs)
    del freqs
    assert key not in rope._TABLES


@pytest.mark.parametrize(
    "fields, packed, inference, reason",
    [
        pytest.param({}, None, None, None, id="fused"),
        pytest.param({"apply_rope_fusion": True}, None, None, "apply_rope_fusion", id="te-fused"),
        pytest.param({"rotary_interleaved": True}, None, None, "interleaved", id="interleaved"),
        pytest.param({}, "thd", None, "packed", id="packed"),
        pytest.param({}, None, object(), "inference", id="inference"),
    ],
)
def test_rope_reason(fields, packed, inference, reason):
    from megatron_hybrid.modules.fast.selection import rope_reason

    config = types.SimpleNamespace(**{"apply_rope_fusion": False, "rotary_interleaved": False,
                                      **fields})  # fmt: skip
    module = types.SimpleNamespace(config=config)
    params = None if packed is None else types.SimpleNamespace(qkv_format=packed)
    found = rope_reason(module, torch.zeros(1), params, inference)
    assert found is None if reason is None else reason in found
    assert rope_reason(module, None, None, None) == "no rotary embedding"

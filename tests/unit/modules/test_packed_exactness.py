"""Packed (THD) == separate for every layer type alone, each with a leaking negative control.

A model of one symbol (``*``, ``+``, ``G``, ``M``, ``-`` or ``E``), built from ``train``'s flags on
the CPU runtime, runs five sequences packed into one THD row with alignment padding between them,
and each sequence alone; the logits at each sequence's tokens must agree to float32 rounding.
Each control breaks exactly what keeps the sequences apart (the attention's per-sequence mask,
GatedDeltaNet's state or conv reset, Mamba's ``seq_idx``, positions restarting per sequence, MoE
routing free of capacity competition) and the same comparison must then fail.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from support.packing import packing_errors, random_sequences

# Measured differences are <= 3e-7 (float32 rounding of differently sized matmuls); a leak moves
# later sequences' logits by O(0.1 - 1).
EXACT = 1e-5
LEAK = 1e-3

MLA_FLAGS = ("--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "16")
MOE_FLAGS = ("--num-experts", "4", "--moe-router-topk", "2")
SYMBOLS = {
    "*": (),
    "+": MLA_FLAGS + ("--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"),
    "G": ("--swiglu",),
    "M": (),
    "-": ("--position-embedding-type", "learned_absolute"),
    "E": MOE_FLAGS + ("--position-embedding-type", "learned_absolute"),
}


def train_config(pattern, *flags, **overrides):
    """``train``'s config of ``pattern`` and ``flags``, with the CPU runtime's settings."""
    from megatron_hybrid.runtime.cpu import cpu_config_overrides
    from megatron_hybrid.training.config import config_from_flags

    return config_from_flags(pattern, *flags, **{**cpu_config_overrides(), **overrides})


def _model(pg, pattern, *flags, **overrides):
    from megatron_hybrid.testing.models import build_hybrid

    config = train_config(pattern, *flags, **overrides)
    position = "learned_absolute" if "learned_absolute" in flags else "rope"
    torch.manual_seed(0)
    model = build_hybrid(
        config, pattern, pg, position_embedding_type=position, max_sequence_length=256
    ).eval()
    # Initial decays forget within a few tokens, so a leaked state would fade in the padding
    # between sequences; weak decays (long memory, as trained models have) carry it over.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.fill_(-4.0)
    return model


@contextlib.contextmanager
def _attention_sees_the_whole_row():
    """The local core attention with one causal mask over the packed row."""
    import megatron_hybrid.modules.attention as attention

    original = attention.thd_segments
    attention.thd_segments = lambda params, total: [(0, total)]
    try:
        yield
    finally:
        attention.thd_segments = original


@contextlib.contextmanager
def _gdn_ignores_boundaries(model, part: str):
    """GatedDeltaNet with its state (``part="state"``) or conv window (``"conv"``) not reset."""
    import megatron.core.ssm.gated_delta_net.gdn as gdn

    layers = [m for m in model.modules() if hasattr(m, "gated_delta_rule")]
    rules = [layer.gated_delta_rule for layer in layers]
    conv = gdn.causal_conv1d
    if part == "state":
        for layer, rule in zip(layers, rules, strict=True):
            layer.gated_delta_rule = lambda *a, rule=rule, cu_seqlens=None, **k: rule(*a, **k)
    else:
        gdn.causal_conv1d = lambda *a, cu_seqlens=None, **k: conv(*a, **k)
    try:
        yield
    finally:
        gdn.causal_conv1d = conv
        for layer, rule in zip(layers, rules, strict=True):
            layer.gated_delta_rule = rule


def _assert_packs_exactly(model, sequences):
    errors = packing_errors(model, sequences)
    assert max(errors) < EXACT, errors
    return errors


@pytest.mark.parametrize("symbol", list(SYMBOLS), ids=list(SYMBOLS))
def test_packed_equals_separate(pg, symbol):
    model = _model(pg, symbol, *SYMBOLS[symbol])
    _assert_packs_exactly(model, random_sequences())


@pytest.mark.parametrize("symbol", ["*", "+"], ids=["attention", "mla"])
def test_control_leaking_attention_mask_fails(pg, symbol):
    model = _model(pg, symbol, *SYMBOLS[symbol])
    with _attention_sees_the_whole_row():
        errors = packing_errors(model, random_sequences())
    assert errors[0] < EXACT and max(errors[1:]) > LEAK, errors


@pytest.mark.parametrize("part", ["state", "conv"])
def test_control_leaking_gated_delta_net_fails(pg, part):
    model = _model(pg, "G", *SYMBOLS["G"])
    with _gdn_ignores_boundaries(model, part):
        errors = packing_errors(model, random_sequences())
    assert errors[0] < EXACT and max(errors[1:]) > LEAK, errors


def test_control_leaking_mamba_state_fails(pg):
    from support.packing import pack_with_gaps

    model = _model(pg, "M")
    sequences = random_sequences()
    packed = pack_with_gaps(sequences)
    params = packed.packed_seq_params
    params.seq_idx = torch.zeros_like(params.seq_idx)  # one sequence: conv and scan run through
    errors = packing_errors(model, sequences, packed)
    assert errors[0] < EXACT and max(errors[1:]) > LEAK, errors


@pytest.mark.parametrize("symbol", ["-", "E"])
def test_control_positions_running_through_the_row_fail(pg, symbol):
    model = _model(pg, symbol, *SYMBOLS[symbol])
    sequences = random_sequences()
    from support.packing import pack_with_gaps

    packed = pack_with_gaps(sequences)
    through = torch.arange(packed.plan.total_tokens).unsqueeze(0)
    errors = packing_errors(model, sequences, packed, packed_position_ids=through)
    assert errors[0] < EXACT and max(errors[1:]) > LEAK, errors


def test_control_moe_capacity_competition_fails(pg):
    """Token dropping makes experts' capacity shared by the whole row: packing is then inexact."""
    flags = MOE_FLAGS + ("--position-embedding-type", "learned_absolute")
    model = _model(pg, "E", *flags, moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs")
    errors = packing_errors(model, random_sequences())
    assert max(errors) > LEAK, errors


def test_packed_attention_is_causal_under_padding_causal_mask_type(pg):
    """``padding_causal`` core attention (the softmax builds no mask of its own) stays causal on
    a THD row: each output equals the ``causal`` one."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hybrid.modules.attention import LocalCoreAttention

    model = _model(pg, "*", *SYMBOLS["*"])
    core = next(m for m in model.modules() if isinstance(m, LocalCoreAttention))
    heads, size = core.num_attention_heads_per_partition, core.hidden_size_per_attention_head
    real, padded = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 8, 16])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                             cu_seqlens_q_padded=padded.int(),
                             cu_seqlens_kv_padded=padded.int())  # fmt: skip
    torch.manual_seed(1)
    q, k, v = (torch.randn(16, heads, size) for _ in range(3))
    causal = core(q, k, v, None, packed_seq_params=params)
    core.attn_mask_type = core.scale_mask_softmax.attn_mask_type = AttnMaskType.padding_causal
    got = core(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(got, causal, rtol=0, atol=0)

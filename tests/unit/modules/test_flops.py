"""FLOP formulas of every built-in layer type against counts worked out by hand.

Each hand count below is written out term by term for a tiny config (two sequences of 3 and 5
tokens: 8 tokens, 6 + 15 = 21 causal (query, key) pairs), independently of the formulas' code.
Negative controls: the same hand counts with a planted mistake (non-causal pairs, the GLU's
second half forgotten, all experts instead of the routed ones) must not match.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_hybrid.modules.flops import SequenceBatch, model_flops
from megatron_hybrid.modules.registry import layer_runtime

BATCH = SequenceBatch((3, 5))  # 8 tokens; causal pairs 3*4/2 + 5*6/2 = 6 + 15 = 21
VOCAB = 10


def _config(**overrides):
    base = dict(
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=4,
        attention_output_gate=False,
        window_size=None,
        ffn_hidden_size=16,
        gated_linear_unit=False,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=6,
        moe_latent_size=None,
        moe_shared_expert_intermediate_size=None,
        moe_shared_expert_gate=False,
        q_lora_rank=None,
        kv_lora_rank=4,
        qk_head_dim=3,
        qk_pos_emb_head_dim=1,
        v_head_dim=2,
        dsa_indexer_n_heads=2,
        dsa_indexer_head_dim=2,
        dsa_indexer_topk=2,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=2,
        linear_value_head_dim=3,
        linear_conv_kernel_dim=4,
        mamba_head_dim=4,
        mamba_state_dim=2,
        mamba_num_groups=2,
        mamba_num_heads=None,
    )
    return types.SimpleNamespace(**{**base, **overrides})


def _hand(symbol: str, bug: str | None = None, **overrides) -> float:
    """The forward FLOPs of one layer of ``symbol``, counted by hand for :func:`_config`."""
    cfg = _config(**overrides)
    pairs = 34 if bug == "non_causal" else 21  # 3*3 + 5*5 = 34 pairs without the mask
    if symbol == "*":
        qkv = 2 * 8 * 8 * (2 * 4 + 2 * 1 * 4)  # tokens, hidden, q heads + k and v of 1 group
        return qkv + 2 * pairs * 2 * 4 + 2 * pairs * 2 * 4 + 2 * 8 * 8 * 8
    if symbol == "+":
        q = 2 * 8 * 8 * 2 * (3 + 1)
        kv_down = 2 * 8 * 8 * (4 + 1)
        kv_up = 2 * 8 * 4 * 2 * (3 + 2)
        out = 2 * 8 * (2 * 2) * 8
        return q + kv_down + kv_up + out + 2 * pairs * 2 * (3 + 1) + 2 * pairs * 2 * 2
    if symbol == "-":
        fc1 = 2 * 8 * 8 * 16 * (1 if bug == "glu_half" or not cfg.gated_linear_unit else 2)
        return fc1 + 2 * 8 * 16 * 8
    if symbol == "E":
        experts = 4 if bug == "all_experts" else 2
        glu = 2 if cfg.gated_linear_unit and bug != "glu_half" else 1
        router = 2 * 8 * 8 * 4
        return router + experts * (2 * 8 * 8 * 6 * glu + 2 * 8 * 6 * 8)
    if symbol == "G":
        in_proj = 2 * 8 * 8 * (2 * 1 * 2 + 2 * 2 * 3 + 2 * 2)  # q, k, v, z, beta, alpha
        conv = 2 * 8 * (2 * 2 + 6) * 4
        c, dk, dv = 64, 2, 3
        per_token_head = (c - 1) * dk + c * c / 3 + 2 * (c + 1) * (dk + dv) + 6 * dk * dv
        return in_proj + conv + 8 * 2 * per_token_head + 2 * 8 * 6 * 8
    if symbol == "M":
        # expand 2: d_inner 16 = 4 heads of 4; 2 groups of state 2; chunk 128; conv width 4.
        in_proj = 2 * 8 * 8 * (2 * 16 + 2 * 2 * 2 + 4)
        conv = 2 * 8 * (16 + 2 * 2 * 2) * 4
        per_token = 2 * 129 * 2 + 4 * (129 * 4 + 4 * 2 * 4)
        return in_proj + conv + 8 * per_token + 2 * 8 * 16 * 8
    raise AssertionError(symbol)


def _formula(symbol: str, **overrides) -> float:
    return sum(layer_runtime(symbol).flops(_config(**overrides), BATCH).values())


CASES = [
    pytest.param("*", {}, id="attention-gqa"),
    pytest.param("+", {}, id="mla"),
    pytest.param("-", {}, id="mlp-gelu"),
    pytest.param("-", {"gated_linear_unit": True}, id="mlp-swiglu"),
    pytest.param("E", {}, id="moe-gelu"),
    pytest.param("E", {"gated_linear_unit": True}, id="moe-swiglu"),
    pytest.param("G", {}, id="gdn"),
    pytest.param("M", {}, id="mamba"),
]


@pytest.mark.parametrize("symbol, overrides", CASES)
def test_layer_formula_matches_hand_count(symbol, overrides):
    assert _formula(symbol, **overrides) == pytest.approx(_hand(symbol, **overrides), rel=1e-12)


@pytest.mark.parametrize(
    "symbol, overrides, bug",
    [
        pytest.param("*", {}, "non_causal", id="attention-non-causal"),
        pytest.param("+", {}, "non_causal", id="mla-non-causal"),
        pytest.param("-", {"gated_linear_unit": True}, "glu_half", id="mlp-glu-half"),
        pytest.param("E", {"gated_linear_unit": True}, "glu_half", id="moe-glu-half"),
        pytest.param("E", {}, "all_experts", id="moe-all-experts"),
    ],
)
def test_planted_counting_mistakes_are_caught(symbol, overrides, bug):
    """Negative control: a hand count with a known mistake differs from the formula."""
    assert _formula(symbol, **overrides) != pytest.approx(_hand(symbol, bug, **overrides))


def test_attention_window_and_output_gate():
    # One sequence of 5 with a left window of 1: the keys per query are 1, 2, 2, 2, 2.
    assert SequenceBatch((5,)).attended_pairs(window=1) == 9
    assert SequenceBatch((5,)).attended_pairs(window=10) == 15
    gated = layer_runtime("*").flops(_config(attention_output_gate=True), BATCH)
    assert gated["qkv_proj"] == 2 * 8 * 8 * (2 * 2 * 4 + 2 * 4)  # the gate doubles q's width


def test_moe_shared_experts_and_latent():
    parts = layer_runtime("E").flops(
        _config(moe_shared_expert_intermediate_size=5, moe_shared_expert_gate=True,
                moe_latent_size=4), BATCH)  # fmt: skip
    assert parts["shared_experts"] == 2 * 8 * 8 * 5 + 2 * 8 * 5 * 8 + 2 * 8 * 8 * 1
    assert parts["latent_proj"] == 2 * (2 * 8 * 8 * 4)
    assert parts["experts_fc1"] == 2 * (2 * 8 * 4 * 6)  # experts work on the latent width


def test_dsa_counts_selected_keys():
    parts = layer_runtime("D").flops(_config(), BATCH)
    # top-2 keys per query: sequence 3 -> 1 + 2 + 2, sequence 5 -> 1 + 2 + 2 + 2 + 2
    assert parts["scores"] == 2 * (5 + 9) * 2 * (3 + 1)
    assert parts["indexer_scores"] == 2 * 21 * 2 * 2


def test_model_flops_sums_layers_output_layer_and_mtp():
    cfg = _config()
    flops = model_flops(cfg, "[*E]-/*E", BATCH, VOCAB)
    output = 2 * 8 * 8 * VOCAB
    main = _hand("*") + _hand("E") + _hand("-")
    mtp = 2 * 8 * 16 * 8 + _hand("*") + _hand("E") + output  # eh_proj [2h -> h], layers, output
    assert flops.forward == pytest.approx(main + output + mtp)
    assert flops.step == pytest.approx(3 * flops.forward)
    assert [symbol for symbol, _ in flops.layers] == ["*", "E", "-", "*", "E"]
    assert flops.mfu(step_seconds=2.0, peak_flops=flops.step) == pytest.approx(0.5)
    without_output = model_flops(cfg, "[*E]-", BATCH, VOCAB, output_layer=False)
    assert without_output.forward == pytest.approx(main)


def test_formulas_read_a_real_transformer_config():
    """The attribute names the formulas read exist on megatron's config, defaults filled in."""
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=6, add_bias_linear=False,
    )  # fmt: skip
    flops = model_flops(cfg, "*E", BATCH, VOCAB)
    # megatron fills in kv_channels = 8 / 2 = 4 and num_query_groups = 2 heads.
    attention = 2 * 8 * 8 * (2 * 4 + 2 * 2 * 4) + 2 * 21 * 2 * 4 * 2 + 2 * 8 * 8 * 8
    assert flops.forward == pytest.approx(attention + _hand("E") + 2 * 8 * 8 * VOCAB)


def test_a_layer_type_without_formula_is_refused():
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_hybrid.modules import register_layer_type, unregister_layer_type
    from megatron_hybrid.modules.layer_types.common import (
        build_transformer_layer,
        forward_transformer_layer,
        run_attention_half,
    )
    from megatron_hybrid.modules.registry import LayerRuntime
    from megatron_hybrid.pattern import LayerTypeFacts, Slot

    facts = LayerTypeFacts(symbol="Q", name="toy mixer", slot=Slot.MIXER, colour="#123456")
    runtime = LayerRuntime(
        symbol="Q", spec_field="toy_layer", build=build_transformer_layer(attention=False),
        forward=forward_transformer_layer, run_pre_dispatch=run_attention_half,
        default_spec=lambda backend: ModuleSpec(module=torch.nn.Identity),
    )  # fmt: skip
    register_layer_type(facts, runtime)
    try:
        with pytest.raises(ValueError, match=r"toy mixer \('Q'\) has no FLOP formula"):
            model_flops(_config(), "Q*", BATCH, VOCAB)
    finally:
        unregister_layer_type("Q")

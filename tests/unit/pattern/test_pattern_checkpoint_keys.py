"""Checkpoint key prefixes (docs/checkpoints.md section 1): logical for grouped patterns,
physical otherwise."""

from __future__ import annotations

import pytest

from megatron_hybrid.checkpointing import decoder_layer_prefix, final_norm_prefix, mtp_layer_prefix
from megatron_hybrid.pattern import parse_pattern


@pytest.mark.parametrize(
    ("pattern", "prefixes"),
    [
        ("[*-]{2}[*E]", ["decoder.layers.0.", "decoder.layers.1.", "decoder.layers.2."]),
        ("M[*E]-", ["decoder.layers.0.", "decoder.layers.1.", "decoder.layers.2."]),
        ("M*E-", [f"decoder.layers.{i}." for i in range(4)]),
        ("[*E]|[*E]", ["decoder.layers.0.", "decoder.layers.1."]),
    ],
    ids=["gpt-like", "mixed", "ungrouped", "pipes-do-not-matter"],
)
def test_decoder_prefixes_use_global_logical_index(pattern, prefixes):
    p = parse_pattern(pattern)
    assert [decoder_layer_prefix(p, layer.index) for layer in p.logical_layers] == prefixes


def test_ungrouped_prefix_is_megatron_core_physical_index():
    p = parse_pattern("M-M*-")
    for layer in p.logical_layers:
        assert (
            decoder_layer_prefix(p, layer.index) == f"decoder.layers.{layer.layer_numbers[0] - 1}."
        )


@pytest.mark.parametrize(
    ("pattern", "prefix"),
    [
        ("[*E]{4}", "decoder.final_layernorm."),
        ("M[*E]", "decoder.final_layernorm."),
        ("M*M*/*E", "decoder.final_norm."),
        ("/*E", "decoder.final_norm."),
    ],
)
def test_final_norm_prefix(pattern, prefix):
    assert final_norm_prefix(pattern) == prefix


def test_mtp_prefix():
    assert mtp_layer_prefix(0, 0) == "mtp.layers.0.mtp_model_layer.layers.0."
    assert mtp_layer_prefix(2, 1) == "mtp.layers.2.mtp_model_layer.layers.1."
    # A GPT-layer MTP depth of a grouped pattern takes GPTModel's key (both members).
    assert mtp_layer_prefix(1, 1, "[*E]{2}/*E/*E") == "mtp.layers.1.transformer_layer."
    assert mtp_layer_prefix(0, 1, "*E/*E") == "mtp.layers.0.mtp_model_layer.layers.1."
    assert mtp_layer_prefix(0, 0, "[*E]{2}/M") == "mtp.layers.0.mtp_model_layer.layers.0."


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: decoder_layer_prefix("[*E]{2}", 2), r"logical_index \(2\) must be < 2"),
        (lambda: decoder_layer_prefix("[*E]{2}", -1), "logical_index must be an integer >= 0"),
        (lambda: mtp_layer_prefix(-1, 0), "depth must be an integer >= 0"),
        (lambda: mtp_layer_prefix(0, True), "index must be an integer >= 0"),
    ],
    ids=["past-end", "negative", "negative-depth", "bool-index"],
)
def test_bad_indices(call, match):
    with pytest.raises(ValueError, match=match):
        call()

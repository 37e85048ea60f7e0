"""Model settings read from checkpoint tensors, and shape mismatches named by their flag."""

from __future__ import annotations

import argparse

import pytest

from megatron_hybrid.checkpointing.settings import mismatched_flags, settings_from_checkpoint

TENSORS = {
    "embedding.word_embeddings.weight": (256, 32),
    "decoder.layers.0.mlp.linear_fc1.weight": (256, 32),
    "decoder.layers.0.mlp.linear_fc2.weight": (32, 128),
    "decoder.layers.1.mlp.experts.linear_fc2.weight0": (32, 64),
    "output_layer.weight": (256, 32),
}


def test_settings_from_tensors():
    assert settings_from_checkpoint(TENSORS) == dict(
        vocab_size=256, hidden_size=32, untie_embeddings_and_output_weights=True,
        ffn_hidden_size=128, swiglu=True, disable_bias_linear=True,
    )  # fmt: skip


def test_stacked_gpt_keys_and_tied_output():
    tensors = {
        "embedding.word_embeddings.weight": (100, 16),
        "decoder.layers.mlp.linear_fc1.weight": (2, 64, 16),  # leading layer dimension
        "decoder.layers.mlp.linear_fc2.weight": (2, 16, 64),
        "decoder.layers.mlp.linear_fc2.bias": (2, 16),
        "decoder.layers.mlp.router.weight": (2, 6, 16),
    }
    found = settings_from_checkpoint(tensors)
    assert found["num_experts"] == 6
    assert (found["ffn_hidden_size"], found["swiglu"], found["disable_bias_linear"]) == (
        64, False, False,
    )  # fmt: skip
    assert found["untie_embeddings_and_output_weights"] is False


@pytest.mark.parametrize(
    ("mismatches", "args", "expected"),
    [
        pytest.param([("embedding.word_embeddings.weight", (256, 64), (256, 32))],
                     dict(hidden_size=64, vocab_size=256),
                     ["--hidden-size 64 does not match the checkpoint's 32"], id="hidden"),
        # ffn = 4 x 64 = 256 = vocab: an MLP's dimension is the FFN size, not the vocabulary.
        pytest.param([("decoder.layers.0.mlp.linear_fc1.weight", (256, 64), (128, 64))],
                     dict(hidden_size=64, vocab_size=256),
                     ["--ffn-hidden-size 256 does not match the checkpoint's 128"],
                     id="ffn-not-vocab"),
        pytest.param([("decoder.layers.0.mlp.router.weight", (8, 64), (4, 64))],
                     dict(hidden_size=64, num_experts=8),
                     ["--num-experts 8 does not match the checkpoint's 4"], id="experts"),
        pytest.param([("decoder.layers.0.self_attention.linear_qkv.weight", (96, 64), (48, 64))],
                     dict(hidden_size=64), [], id="unexplained"),
    ],
)  # fmt: skip
def test_mismatched_flags(mismatches, args, expected):
    assert mismatched_flags(mismatches, argparse.Namespace(**args)) == expected

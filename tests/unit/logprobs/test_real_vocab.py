"""The real vocabulary travels with the model: a padded output layer's extra rows (Megatron-LM
pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP) stay out of the softmax
by default, for a model built with ``real_vocab_size``, one built by the Megatron-LM glue, and one
loaded from a checkpoint that records it; the control counts the padding rows."""

from __future__ import annotations

import argparse
import sys
import types

import pytest
import torch
from support.packing import random_sequences

PATTERN, PADDED, REAL = "[*-]", 128, 120
EXACT = 1e-5  # float32 logits, float64 reference: the bound of test_forward_logprobs.py


def _padded_model(pg, real=REAL):
    from megatron_hybrid.testing.models import build_hybrid, small_config

    torch.manual_seed(0)
    model = build_hybrid(small_config(PATTERN), PATTERN, pg, vocab_size=PADDED,
                         real_vocab_size=real)  # fmt: skip
    with torch.no_grad():  # padding rows with large logits: they would take most of the mass
        model.output_layer.weight[REAL:] *= 30
    return model


def _reference(model, sequences):
    """log_softmax over the real vocabulary of each sequence's own logits (float64)."""
    out = []
    with torch.no_grad():
        for s in sequences:
            logits = model(s.unsqueeze(0), torch.arange(len(s)).unsqueeze(0), None)[0]
            log_p = torch.log_softmax(logits[:, :REAL].double(), -1)[:-1]
            out.append(log_p.gather(-1, s[1:, None]).squeeze(-1))
    return out


def _error(got, want) -> float:
    return max((a.double() - b).abs().max().item() for a, b in zip(got, want, strict=True))


def test_padding_rows_are_left_out_by_default(pg):
    from megatron_hybrid.logprobs import forward_logprobs

    model = _padded_model(pg)
    assert model.real_vocab_size == REAL and model.vocab_size == PADDED
    sequences = random_sequences((5, 17, 9), vocab_size=REAL, seed=2)
    want = _reference(model, sequences)
    assert _error(forward_logprobs(model, sequences), want) <= EXACT
    # Control: the vocabulary not known (the padded size) counts the padding rows.
    assert _error(forward_logprobs(model, sequences, vocab_size=PADDED), want) > 0.5


def test_real_vocab_beyond_the_rows_is_refused(pg):
    with pytest.raises(ValueError, match="real_vocab_size=129 exceeds vocab_size=128"):
        _padded_model(pg, real=PADDED + 1)


def test_checkpoint_records_the_real_vocabulary(pg, tmp_path):
    from megatron_hybrid.checkpointing.store import read_model_state
    from megatron_hybrid.logprobs import forward_logprobs
    from megatron_hybrid.testing.models import build_hybrid, small_config
    from megatron_hybrid.training.checkpoint import apply_recorded_vocab, save_checkpoint
    from megatron_hybrid.training.optimizers import CPUOptimizer

    model = _padded_model(pg)
    optimizer = CPUOptimizer([model], lr=1e-3, weight_decay=0.0, clip_grad=0.0, pg_collection=None)
    folder = save_checkpoint(tmp_path / "run", 1, [model], optimizer, pattern=PATTERN)
    sequences = random_sequences((6, 11), vocab_size=REAL, seed=4)
    want = forward_logprobs(model, sequences)
    # A model built from the flags knows only the padded vocabulary until the record says more.
    loaded = build_hybrid(small_config(PATTERN), PATTERN, pg, vocab_size=PADDED)
    read_model_state(folder, [loaded])
    assert _error(forward_logprobs(loaded, sequences), want) > 0.5  # the control
    assert apply_recorded_vocab([loaded], folder) == REAL
    assert _error(forward_logprobs(loaded, sequences), want) == 0.0


def test_megatron_lm_models_know_the_tokenizer_vocabulary(pg, monkeypatch):
    """model_provider (Python 3.11 cannot import megatron.training: stood in for here)."""
    from megatron_hybrid.testing.models import small_config
    from megatron_hybrid.training import megatron_lm

    args = argparse.Namespace(
        padded_vocab_size=PADDED, vocab_size=None, max_position_embeddings=64,
        megatron_hybrid_layer_pattern=PATTERN, fp16_lm_cross_entropy=False,
        untie_embeddings_and_output_weights=True, position_embedding_type="rope",
        rotary_percent=1.0, rotary_base=10000, transformer_impl="local",
        make_vocab_size_divisible_by=128,
    )  # fmt: skip
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    training.get_tokenizer = lambda: types.SimpleNamespace(vocab_size=REAL)
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.core_transformer_config_from_args = lambda a: small_config(PATTERN)
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", arguments)
    model = megatron_lm.model_provider(pg_collection=pg)
    assert (model.vocab_size, model.real_vocab_size) == (PADDED, REAL)
    args.vocab_size = 100  # --vocab-size given: it is the real vocabulary
    assert megatron_lm.model_provider(pg_collection=pg).real_vocab_size == 100

"""Tokenizers for the data tests, built locally (no download)."""

from __future__ import annotations

import pytest

from megatron_hybrid.testing.tokenizers import CHATML, CHATML_GENERATION, build_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE with a ChatML template that does not mark the assistant's tokens."""
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer") / "chatml", chat_template=CHATML)


@pytest.fixture(scope="session")
def generation_tokenizer_dir(tmp_path_factory, tokenizer_dir):
    """The same tokenizer, its template marking the assistant's tokens with {% generation %}.

    The same one, not one trained again: BPE training breaks ties between equally frequent
    pairs in no fixed order, so two trainings on one corpus can merge differently (seen once:
    two token ids apart)."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tokenizer") / "generation"
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = CHATML_GENERATION
    tokenizer.save_pretrained(str(folder))
    return folder

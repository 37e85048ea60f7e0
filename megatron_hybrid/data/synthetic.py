"""The built-in data: deterministic synthetic variable-length token sequences.

The embedded default data set needs no download: sequences follow a sparse first-order Markov
chain (every token has two likely successors), so a small model learns it within a few dozen
steps and the loss visibly falls. Sequence ``i`` depends only on ``(seed, split, i)``, so any
step of any data-parallel rank can be regenerated, which makes resuming exact. The validation
split draws other sequences from the same chain.

Every sequence has its own random stream, keyed by ``(seed, stream, index, part)`` through
numpy's ``SeedSequence`` (the whole key is hashed). torch's CPU generator was used before, but
its Mersenne Twister keeps only the low 32 bits of a seed, so the validation split, numbered
from ``1 << 40``, drew exactly the training split's sequences.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from megatron_hybrid.data.samples import TokenSample

__all__ = ["PAD_TOKEN_ID", "SyntheticSamples", "SyntheticTokens"]

#: Token 0 is reserved for padding (the chain never emits it).
PAD_TOKEN_ID = 0

# The streams of the key ``(seed, stream, index, part)``: one sequence per sample of a split, or
# the ``part``-th sequence of sample ``index`` of ``documents`` samples.
_STREAMS = {("train", False): 0, ("valid", False): 1, ("train", True): 2, ("valid", True): 3,
            ("test", False): 4, ("test", True): 5}  # fmt: skip


@dataclass(frozen=True)
class SyntheticTokens:
    """Variable-length sequences from a fixed sparse Markov chain.

    Attributes:
        vocab_size: vocabulary size (token 0 is reserved for padding).
        max_length: longest sequence in tokens (inputs; one more token is drawn for the labels).
        seed: data seed.
        min_length: shortest sequence.
    """

    vocab_size: int
    max_length: int
    seed: int = 1234
    min_length: int = 8

    def __post_init__(self):
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be at least 4, got {self.vocab_size}")
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(
                f"need 1 <= min_length ({self.min_length}) <= max_length ({self.max_length})"
            )

    @cached_property
    def _successors(self) -> torch.Tensor:
        """The Markov chain's two successors of every token (drawn once per dataset)."""
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randint(1, self.vocab_size, (self.vocab_size, 2), generator=generator)

    def sequence(
        self, index: int, stream: int = 0, part: int = 0, limit: int | None = None
    ) -> torch.Tensor:
        """Tokens ``[L + 1]`` of sequence ``index`` of ``stream`` (and ``part``) (inputs are
        ``[:-1]``, labels ``[1:]``); with ``limit``, its first ``limit`` tokens only (the same
        as cutting the whole sequence, without walking the rest)."""
        draws = np.random.default_rng([self.seed, stream, index, part])
        # Log-normal lengths, like pretraining documents, clipped to the allowed range.
        median = max(self.min_length, self.max_length // 2)
        draw = draws.lognormal(math.log(median), 0.6)
        length = int(min(self.max_length, max(self.min_length, round(draw))))
        token = int(draws.integers(1, self.vocab_size))
        choices = (draws.random(length) > 0.8).tolist()
        if limit is not None:
            if limit < 1:
                raise ValueError(f"SyntheticTokens.sequence: limit must be >= 1, got {limit}")
            choices = choices[: limit - 1]
        # The walk on Python ints, each step one lookup in the flat successor list from C's
        # loop: indexing a tensor per token cost ~30 ms per 2,000-token sequence, host time
        # inside every training step; a Python loop over nested lists ~0.45 us a token, this
        # ~0.17 (one CPU core, 2026-11-29).
        walk = itertools.accumulate(choices, self._step, initial=token)
        return torch.from_numpy(np.fromiter(walk, dtype=np.int64, count=len(choices) + 1))

    @cached_property
    def _step(self) -> Callable[[int, bool], int]:
        """``(token, choice) -> successor``: the table as one flat list, two entries a token."""
        flat = self._successors.flatten().tolist()
        return lambda token, choice: flat[token + token + choice]


@dataclass(frozen=True)
class SyntheticSamples:
    """One split of the synthetic data as a sample source.

    Attributes:
        tokens: the chain.
        split: ``"train"``, ``"valid"`` or ``"test"``.
        documents: every sample ``max_length`` inputs cut from whole sequences laid back to back
            (the last one cut short), each a document piece of its own, as megatron-core's
            ``GPTDataset`` cuts samples from a corpus of documents (``--synthetic-samples
            documents``); False: every sample is one sequence (its length varies).
    """

    tokens: SyntheticTokens
    split: str = "train"
    documents: bool = False

    @property
    def max_documents_per_sample(self) -> int:
        """The most document pieces a sample holds (packing reserves their alignment padding):
        every sequence is at least ``min_length + 1`` tokens long in the stream."""
        if not self.documents:
            return 1  # a sample is one sequence: packing never splits one
        return -(-(self.tokens.max_length + 1) // (self.tokens.min_length + 1))

    def sample(self, index: int) -> TokenSample:
        stream = _STREAMS[self.split, self.documents]
        if not self.documents:
            return TokenSample(self.tokens.sequence(index, stream))
        # Sample i's documents are sequences of their own (parts 0, 1, ... of index i), so any
        # sample is made without the ones before it, as resuming needs.
        needed, parts = self.tokens.max_length + 1, []
        while needed > 0:
            part = self.tokens.sequence(index, stream, len(parts), limit=needed)
            parts.append(part)
            needed -= len(part)
        pieces = [len(p) for p in parts]
        pieces[-1] -= 1  # the stream's last token is a label only
        return TokenSample(torch.cat(parts), documents=tuple(n for n in pieces if n))

    def describe(self) -> str:
        what = (
            f"samples of {self.tokens.max_length} tokens of whole sequences back to back"
            if self.documents
            else "one sequence per sample"
        )
        return (
            f"synthetic Markov tokens (built in; vocabulary {self.tokens.vocab_size}, sequences "
            f"of {self.tokens.min_length} to {self.tokens.max_length} tokens, {what})"
        )

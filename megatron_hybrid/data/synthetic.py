"""The built-in data: deterministic synthetic variable-length token sequences.

The embedded default data set needs no download: sequences follow a sparse first-order Markov
chain (every token has two likely successors), so a small model learns it within a few dozen
steps and the loss visibly falls. Sequence ``i`` depends only on ``(seed, split, i)``, so any
step of any data-parallel rank can be regenerated, which makes resuming exact. The validation
split draws other sequences from the same chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from megatron_hybrid.data.samples import TokenSample

__all__ = ["PAD_TOKEN_ID", "SyntheticSamples", "SyntheticTokens"]

#: Token 0 is reserved for padding (the chain never emits it).
PAD_TOKEN_ID = 0

# Sequence seeds of the validation split live in their own range (training ones start at 0).
_VALID_OFFSET = 1 << 40


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

    def sequence(self, index: int) -> torch.Tensor:
        """Tokens ``[L + 1]`` of sequence ``index`` (inputs are ``[:-1]``, labels ``[1:]``)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        # Log-normal lengths, like pretraining documents, clipped to the allowed range.
        median = max(self.min_length, self.max_length // 2)
        draw = torch.empty(1).log_normal_(math.log(median), 0.6, generator=generator).item()
        length = int(min(self.max_length, max(self.min_length, round(draw))))
        token = int(torch.randint(1, self.vocab_size, (1,), generator=generator))
        choices = (torch.rand(length, generator=generator) > 0.8).tolist()
        # The walk on Python ints: indexing a tensor per token cost ~30 ms per 2,000-token
        # sequence, host time inside every training step; this is ~100x less.
        successors, walk = self._successor_rows, [token]
        for choice in choices:
            token = successors[token][choice]
            walk.append(token)
        return torch.tensor(walk, dtype=torch.long)

    @cached_property
    def _successor_rows(self) -> list[list[int]]:
        return self._successors.tolist()


@dataclass(frozen=True)
class SyntheticSamples:
    """One split of the synthetic data as a sample source (every sample one document).

    Attributes:
        tokens: the chain.
        split: ``"train"`` or ``"valid"``.
    """

    tokens: SyntheticTokens
    split: str = "train"

    #: A sample is one sequence: packing never splits one.
    max_documents_per_sample = 1

    def sample(self, index: int) -> TokenSample:
        offset = _VALID_OFFSET if self.split == "valid" else 0
        return TokenSample(self.tokens.sequence(offset + index))

    def describe(self) -> str:
        return (
            f"synthetic Markov tokens (built in; vocabulary {self.tokens.vocab_size}, sequences "
            f"of {self.tokens.min_length} to {self.tokens.max_length} tokens)"
        )

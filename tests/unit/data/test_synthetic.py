"""The built-in synthetic data: each sequence a walk on the chain's successor table, lengths in
range, the same sequence for the same ``(seed, index)``, and sequences generated fast enough to
sit inside a training step."""

from __future__ import annotations

import math
import time

import pytest
import torch

from megatron_hybrid.data.synthetic import SyntheticTokens


def _walk_reference(chain: SyntheticTokens, index: int) -> torch.Tensor:
    """The chain's definition, step by step on tensors (the slow original)."""
    generator = torch.Generator().manual_seed(chain.seed * 1_000_003 + index)
    median = max(chain.min_length, chain.max_length // 2)
    draw = torch.empty(1).log_normal_(math.log(median), 0.6, generator=generator)
    length = int(min(chain.max_length, max(chain.min_length, round(draw.item()))))
    tokens = torch.empty(length + 1, dtype=torch.long)
    tokens[0] = int(torch.randint(1, chain.vocab_size, (1,), generator=generator))
    choices = (torch.rand(length, generator=generator) > 0.8).long()
    for i in range(length):
        tokens[i + 1] = chain._successors[tokens[i], choices[i]]
    return tokens


@pytest.mark.parametrize(
    ("vocab", "longest", "seed"), [(256, 32, 1234), (32768, 512, 7)], ids=["small", "wide"]
)
def test_sequences_are_the_chains_walks(vocab, longest, seed):
    chain = SyntheticTokens(vocab, max_length=longest, seed=seed)
    for index in [0, 1, 17, 1 << 40]:
        tokens = chain.sequence(index)
        assert torch.equal(tokens, _walk_reference(chain, index)), index
        assert tokens.dtype == torch.long and chain.min_length + 1 <= len(tokens) <= longest + 1
        assert int(tokens.min()) >= 1 and int(tokens.max()) < vocab  # 0 is the pad token
        assert torch.equal(
            tokens, SyntheticTokens(vocab, max_length=longest, seed=seed).sequence(index)
        )


def test_a_steps_sequences_cost_a_fraction_of_the_step_by_step_walk():
    """Eight sequences of up to 4,096 tokens (one step of the issue's shape): the walk on Python
    ints, against the per-token tensor indexing it replaced (~250 ms a step here, host time
    inside every training step), on the same machine."""
    chain = SyntheticTokens(32768, max_length=4096)
    chain.sequence(0)  # the successor table, once
    start = time.perf_counter()
    tokens = sum(len(chain.sequence(i)) for i in range(1, 9))
    fast = time.perf_counter() - start
    start = time.perf_counter()
    assert sum(len(_walk_reference(chain, i)) for i in range(1, 9)) == tokens > 8 * 500
    slow = time.perf_counter() - start
    assert fast * 5 < slow, (fast, slow)

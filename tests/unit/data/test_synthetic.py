"""The built-in synthetic data: each sequence a walk on the chain's successor table, lengths in
range, the same sequence for the same ``(seed, index)``, and sequences generated fast enough to
sit inside a training step."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
import torch

from megatron_hybrid.data.synthetic import SyntheticSamples, SyntheticTokens


def _walk_reference(chain: SyntheticTokens, index: int, stream=0, part=0) -> torch.Tensor:
    """The chain's definition, step by step on tensors (the slow original)."""
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [chain.seed, stream, index, part])))  # fmt: skip
    median = max(chain.min_length, chain.max_length // 2)
    draw = generator.lognormal(math.log(median), 0.6)
    length = int(min(chain.max_length, max(chain.min_length, round(draw))))
    tokens = torch.empty(length + 1, dtype=torch.long)
    tokens[0] = int(generator.integers(1, chain.vocab_size))
    choices = torch.from_numpy(generator.random(length) > 0.8).long()
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


@pytest.mark.parametrize(
    ("longest", "shortest"), [(64, 8), (512, 8), (40, 40)], ids=["short", "long", "one-length"]
)
def test_documents_samples_are_full_rows_of_whole_sequences(longest, shortest):
    """``--synthetic-samples documents``: every sample ``max_length`` inputs, cut from the
    chain's own sequences laid back to back (the last one cut short), each a document piece
    whose boundaries are exactly the sequences' joins; samples of one split never share a
    sequence, and the validation split draws others."""
    chain = SyntheticTokens(256, max_length=longest, min_length=shortest)
    source = SyntheticSamples(chain, "train", documents=True)
    seen = set()
    for index in [0, 1, 5, 1000]:
        sample = source.sample(index)
        assert sample.length == longest and sum(sample.pieces) == longest
        assert len(sample.pieces) <= source.max_documents_per_sample
        # Written out: walk the sequences and cut the stream at longest + 1 tokens.
        stream, joins, number = [], [], 0
        while len(stream) < longest + 1:
            sequence = _walk_reference(chain, index, stream=2, part=number).tolist()
            joins.append(len(stream))
            stream += sequence
            number += 1
        assert sample.tokens.tolist() == stream[: longest + 1]
        starts = [0, *itertools.accumulate(sample.pieces)][:-1]
        assert starts == [j for j in joins if j < longest]
        seen.add(tuple(sample.tokens[:8].tolist()))
        assert torch.equal(sample.tokens, source.sample(index).tokens)  # regenerated alike
    assert len(seen) == 4
    other = SyntheticSamples(chain, "valid", documents=True).sample(0)
    assert not torch.equal(other.tokens, source.sample(0).tokens)


@pytest.mark.parametrize("documents", [False, True], ids=["sequence", "documents"])
def test_validation_samples_are_not_training_samples(documents):
    """The two splits draw different sequences at every index. Control: the previous keying
    (torch's generator seeded with ``seed * 1_000_003 + index``, the validation split numbered
    from ``1 << 40``) drew the same ones, since the generator keeps only a seed's low 32 bits."""
    chain = SyntheticTokens(256, max_length=64)
    train, valid = (SyntheticSamples(chain, split, documents) for split in ("train", "valid"))
    for index in range(20):
        assert not torch.equal(train.sample(index).tokens, valid.sample(index).tokens), index

    def old_keying(index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(chain.seed * 1_000_003 + index)
        return torch.rand(8, generator=generator)

    assert torch.equal(old_keying(3), old_keying(3 + (1 << 40)))


def test_sequence_samples_stay_one_sequence_each():
    chain = SyntheticTokens(256, max_length=64)
    source = SyntheticSamples(chain, "train")
    assert source.max_documents_per_sample == 1
    for index in [0, 3]:
        sample = source.sample(index)
        assert torch.equal(sample.tokens, chain.sequence(index)) and sample.documents is None


def test_a_negative_seed_is_refused():
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        SyntheticTokens(256, max_length=64, seed=-1)


@pytest.mark.parametrize("limit", [1, 7, 100, 10_000], ids=lambda n: f"limit-{n}")
def test_a_limited_sequence_is_the_whole_one_cut(limit):
    """``limit`` walks only the tokens it keeps: the same as cutting the whole sequence (longer
    limits keep it whole); a limit below one token is refused."""
    chain = SyntheticTokens(256, max_length=512, seed=3)
    for index in (0, 5):
        whole = chain.sequence(index, stream=2, part=1)
        assert torch.equal(chain.sequence(index, stream=2, part=1, limit=limit), whole[:limit])
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        chain.sequence(0, limit=0)

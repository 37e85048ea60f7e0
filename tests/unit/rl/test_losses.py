"""The policy loss as pure math (``megatron_hybrid.rl.losses``), no megatron.

The per-token terms against the formula written out by hand on tokens chosen so that each
branch is taken (ratio inside, below and above the clip range, positive and negative advantages,
asymmetric clips), and ``aggregate`` against verl's ``agg_loss`` definitions computed on a padded
``[sequences, tokens]`` matrix (verl, ``verl/trainer/ppo/core_algos.py``, ``agg_loss``),
including a sequence without loss-masked tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_hybrid.rl.losses import (
    LOSS_AGGREGATIONS,
    PolicyLoss,
    aggregate,
    sequence_weights,
    token_terms,
)


def test_terms_take_every_branch_of_the_clipped_surrogate():
    settings = PolicyLoss(clip_eps=0.2, clip_eps_high=0.3)
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    # ratios exp(logp - old): 1.1 (inside), 0.5 (below 0.8), 2.0 (above 1.3), each with A > 0
    # and A < 0.
    ratios = torch.tensor([1.1, 0.5, 2.0, 1.1, 0.5, 2.0], dtype=torch.float64)
    old = logp - ratios.log()
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    terms = token_terms(logp, advantages, settings, old_logprobs=old)
    # -min(r A, clip(r, 0.8, 1.3) A) token by token.
    want = [-1.1, -0.5, -1.3, 1.1, 0.8, 2.0]
    torch.testing.assert_close(terms.policy, torch.tensor(want, dtype=torch.float64))
    # Clipped where the clipped term is the larger loss: r above the top with A > 0, below the
    # bottom with A < 0.
    assert terms.clipped.tolist() == [0, 0, 1, 0, 1, 0]


def test_kl_and_entropy_terms():
    settings = PolicyLoss(kl_coef=0.5, entropy_coef=0.1)
    logp = torch.tensor([-0.5, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    entropy = torch.tensor([2.0, 3.0], dtype=torch.float64)
    advantages = torch.tensor([0.3, -0.7], dtype=torch.float64)
    terms = token_terms(logp, advantages, settings, ref_logprobs=ref, entropy=entropy)
    kl = [math.exp(d) - d - 1 for d in (-0.5, 1.0)]
    torch.testing.assert_close(terms.kl, torch.tensor(kl, dtype=torch.float64))
    # Without old log-probs the ratio is 1: the policy term is -A.
    want = [-a + 0.5 * k - 0.1 * h for a, k, h in zip((0.3, -0.7), kl, (2.0, 3.0), strict=True)]
    torch.testing.assert_close(terms.loss(settings), torch.tensor(want, dtype=torch.float64))


def test_without_old_logprobs_the_gradient_is_minus_the_advantage():
    logp = torch.tensor([-0.4, -1.5], requires_grad=True)
    advantages = torch.tensor([2.0, -3.0])
    token_terms(logp, advantages, PolicyLoss()).policy.sum().backward()
    torch.testing.assert_close(logp.grad, -advantages)


def _verl_agg_loss(losses, masks, mode):
    """verl's agg_loss on the padded matrix of the whole batch (global_batch_size: None)."""
    width = max(len(x) for x in losses)
    mat = torch.zeros(len(losses), width, dtype=torch.float64)
    mask = torch.zeros(len(losses), width, dtype=torch.float64)
    for i, (loss, m) in enumerate(zip(losses, masks, strict=True)):
        mat[i, : len(loss)], mask[i, : len(m)] = loss, m
    if mode == "token-mean":
        return (mat * mask).sum() / mask.sum()
    counts = mask.sum(-1)
    seq_mask = (counts > 0).double()
    sums = (mat * mask).sum(-1)
    seq = sums if mode == "seq-mean-token-sum" else sums / (counts + 1e-8)
    return (seq * seq_mask).sum() / seq_mask.sum()


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregate_is_verls_agg_loss(mode):
    gen = torch.Generator().manual_seed(1)  # 3, 6, 0 and 4 loss-masked tokens
    lengths = (5, 9, 3, 7)
    losses = [torch.randn(n, generator=gen, dtype=torch.float64) for n in lengths]
    masks = [(torch.rand(n, generator=gen) > 0.4).double() for n in lengths]
    masks[2] = torch.zeros(3, dtype=torch.float64)  # a sequence without loss-masked tokens
    masks[0][0] = 1.0
    got = aggregate(losses, masks, mode)
    torch.testing.assert_close(got, _verl_agg_loss(losses, masks, mode), rtol=1e-7, atol=0)
    # Negative control: each mode differs from the others on these uneven sequences.
    others = [aggregate(losses, masks, m) for m in LOSS_AGGREGATIONS if m != mode]
    assert all(abs(float(got - other)) > 1e-3 for other in others)


def test_sequence_weights_and_counts():
    mask = torch.tensor([0, 1, 1, 0, 1])
    assert sequence_weights(mask, "token-mean")[1] == 3
    weights, count = sequence_weights(mask, "seq-mean-token-mean")
    torch.testing.assert_close(weights, mask / 3.0)
    assert count == 1
    assert sequence_weights(torch.zeros(4), "seq-mean-token-sum")[1] == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_eps=0.0), "clip_eps must be > 0"),
        (dict(clip_eps=1.5), "clip_eps must be < 1"),
        (dict(clip_eps_high=-0.1), "clip_eps_high must be > 0"),
        (dict(kl_coef=-1.0), "kl_coef must be >= 0"),
        (dict(entropy_coef=float("nan")), "entropy_coef must be a finite number"),
        (dict(loss_agg="seq-mean"), "loss_agg='seq-mean': choose one of token-mean"),
    ],
    ids=["clip-0", "clip-1.5", "clip-high", "kl", "entropy-nan", "loss-agg"],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLoss(**kwargs)

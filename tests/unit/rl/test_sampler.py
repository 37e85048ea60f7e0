"""``megatron_hybrid.rl.sample``: greedy decoding equals transformers' ``generate``, draws follow
the tempered, nucleus-truncated distribution.

Greedy: dense, MoE and GatedDeltaNet families against ``generate(do_sample=False)`` (its KV and
recurrent caches) on the same weights, compared while transformers' own top-two logit margin
stays above 1e-4 (our logits are within about 1e-6 of its; a closer race is a tie either may
win). TP2 and EP2 are checked in ``test_policy_step.py``'s two-rank run.
"""

from __future__ import annotations

import math

import pytest
import rl_oracle
import torch
from rl_oracle import NEW_TOKENS, assert_greedy_matches, prompts, transformers_greedy


@pytest.mark.parametrize("family", list(rl_oracle.FAMILIES))
def test_greedy_equals_transformers_generate(pg, family, rl_folders):
    from megatron_hybrid.hf import load_hf_model
    from megatron_hybrid.rl import sample

    folder = rl_folders[family]
    model = load_hf_model(folder)
    got = sample(model, prompts(), max_new_tokens=NEW_TOKENS, temperature=0, seed=0)
    assert_greedy_matches(got, transformers_greedy(folder, rl_oracle.FAMILIES[family][0]), family)
    assert all(m.training for m in model.modules())  # the mode is restored


def test_draws_follow_the_tempered_nucleus():
    from megatron_hybrid.rl.sampler import choose_tokens

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    temperature, top_p = 0.7, 0.8
    probs = torch.softmax(logits.double()[0] / temperature, -1)
    # The nucleus: the most likely tokens until their mass reaches top_p (tokens 0, 1).
    keep = (probs.cumsum(0) - probs) < top_p
    want = torch.where(keep, probs, torch.zeros_like(probs))
    want = want / want.sum()
    n = 20000
    gen = torch.Generator().manual_seed(0)
    draws = choose_tokens(logits.expand(n, -1), temperature=temperature, top_p=top_p, generator=gen)
    counts = torch.bincount(draws, minlength=6).double() / n
    assert counts[~keep].sum() == 0  # never outside the nucleus
    for p, f in zip(want.tolist(), counts.tolist(), strict=True):
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12, (f, p)
    # Control: without the nucleus the third token is drawn as often as its probability says.
    full = choose_tokens(logits.expand(n, -1), temperature=temperature, top_p=1.0, generator=gen)
    assert abs(float((full == 2).double().mean()) - float(probs[2])) < 0.02
    assert choose_tokens(logits, temperature=0, top_p=1.0, generator=gen).tolist() == [0]


def test_the_seed_decides_the_draws(pg, rl_folders):
    from megatron_hybrid.hf import load_hf_model
    from megatron_hybrid.rl import sample

    model = load_hf_model(rl_folders["moe"])
    runs = [sample(model, prompts(), max_new_tokens=4, seed=s) for s in (1, 1, 2)]
    assert [t.tolist() for t in runs[0]] == [t.tolist() for t in runs[1]]
    assert [t.tolist() for t in runs[0]] != [t.tolist() for t in runs[2]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be >= 0"),
        (dict(temperature=-0.5), r"temperature must be >= 0 \(0: greedy\)"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(seed=1.5), "seed must be an int"),
        (
            dict(prompts=[torch.tensor([1, 999])]),
            r"sequence 0 holds token id 999 at position 1, outside",
        ),
    ],
    ids=["new-tokens", "temperature", "top-p", "seed", "token-id"],
)
def test_bad_input_is_refused(pg, rl_folders, kwargs, match):
    from megatron_hybrid.hf import load_hf_model
    from megatron_hybrid.rl import sample

    model = load_hf_model(rl_folders["dense"])
    arguments = {**dict(prompts=prompts(), max_new_tokens=2, seed=0), **kwargs}
    with pytest.raises(ValueError, match="sample: " + match):
        sample(model, arguments.pop("prompts"), **arguments)

"""``PolicyTrainer`` beyond the step's numbers: log-probs, LoRA, bad input (TP1, this process).

LoRA: adapters start with ``B = 0``, so the loss's gradient with respect to ``A`` is zero and
with respect to ``B`` of a module with weight ``W`` is ``scale x dL/dW x A^T``; one sgd step must
move ``B`` by ``-lr`` times that, with ``dL/dW`` from transformers (the oracle of
``test_policy_step.py``) and the base and ``A`` untouched bitwise.
"""

from __future__ import annotations

import pytest
import torch
from rl_oracle import EPS32, LR, VARIANTS, bound

FAMILY = "moe"


@pytest.fixture
def model(pg, rl_folders):
    from megatron_hybrid.hf import load_hf_model

    return load_hf_model(rl_folders[FAMILY])


def test_logprobs_are_forward_logprobs(model, rl_cases):
    from megatron_hybrid.logprobs import forward_logprobs
    from megatron_hybrid.rl import PolicyTrainer

    sequences = rl_cases[FAMILY][0].sequences
    trainer = PolicyTrainer(model, lr=1e-3, temperature=0.7)
    logprobs, entropies = trainer.logprobs(sequences, with_entropy=True)
    want_lp, want_h = forward_logprobs(model, sequences, temperature=0.7, with_entropy=True)
    assert all(torch.equal(a, b) for a, b in zip(logprobs, want_lp, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(entropies, want_h, strict=True))
    # Control: at another temperature they differ.
    plain = forward_logprobs(model, sequences)
    assert max((a - b).abs().max().item() for a, b in zip(logprobs, plain, strict=True)) > 1e-2


def _module(peft_name: str) -> str:
    """``base_model.model.<module>.lora_A.weight`` -> ``<module>``."""
    return peft_name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]


def test_lora_step_moves_only_b_by_the_chain_rule(model, rl_cases):
    from megatron_hybrid.peft import LoRAConfig, apply_lora, iter_lora_weights
    from megatron_hybrid.rl import PolicyTrainer

    rank, alpha = 4, 8.0
    apply_lora(model, LoRAConfig(rank=rank, alpha=alpha))
    trainer = PolicyTrainer(model, optimizer="sgd", lr=LR, clip_grad=0.0)

    def adapters():
        return {n: t.double().clone() for n, t in iter_lora_weights(model, format="per_expert")}

    base = {n: t.clone() for n, t in trainer.iter_hf_weights(merge_lora=False)}
    before = adapters()
    batch, oracle = rl_cases[FAMILY]
    variant = VARIANTS[1]  # token-mean with old/reference log-probs, KL and entropy
    metrics = trainer.step(batch.sequences, **variant.step_kwargs(batch))
    after = adapters()
    assert metrics.skipped is None
    assert all(torch.equal(t, base[n]) for n, t in trainer.iter_hf_weights(merge_lora=False))
    _, grads = oracle[variant.name]
    limit_g = bound(grads, {n: t.double() for n, t in base.items()})
    checked = 0
    for name, value in after.items():
        if ".lora_A." in name:
            assert torch.equal(value, before[name]), name
            continue
        a = before[name.replace(".lora_B.", ".lora_A.")]
        want = (alpha / rank) * grads[f"{_module(name)}.weight"] @ a.T
        moved = (before[name] - value) / LR
        # An error of limit_g in each gradient entry reaches B through a row of |A|.
        limit = (alpha / rank) * limit_g * a.abs().sum(-1).max().item() + EPS32 * (
            value.abs().max().item() / LR
        )
        assert (moved - want).abs().max().item() <= limit, name
        assert want.abs().max().item() > 100 * limit, name  # the check is not vacuous
        checked += 1
    assert checked >= 10
    merged = dict(trainer.iter_hf_weights(merge_lora=True))
    assert any(not torch.equal(merged[n], base[n]) for n in base)


def _inputs(batch, **changes):
    kwargs = dict(loss_masks=batch.loss_masks, advantages=batch.advantages)
    kwargs.update(changes)
    return kwargs


def _nan(values):
    return [torch.full_like(x, float("nan")) for x in values]


BAD_STEP_INPUT = {
    "masks-count": (
        lambda b: dict(loss_masks=b.loss_masks[:-1]),
        r"loss_masks must be a list of one tensor per sequence \(6\), got 5 entries",
    ),
    "advantage-length": (
        lambda b: dict(advantages=[a[:-1] for a in b.advantages]),
        r"advantages\[0\] has shape \(18,\); sequence 0 has 20 tokens, so it needs 19",
    ),
    "mask-values": (
        lambda b: dict(loss_masks=[m * 2 for m in b.loss_masks]),
        r"loss_masks\[0\] holds values other than 0 and 1",
    ),
    "kl-without-ref": (lambda b: dict(kl_coef=0.1), "kl_coef=0.1 needs ref_logprobs"),
    "nan-old": (
        lambda b: dict(old_logprobs=_nan(b.old)),
        r"old_logprobs\[0\] is NaN or infinite at a loss-masked token",
    ),
    "loss-agg": (lambda b: dict(loss_agg="sum"), "loss_agg='sum': choose one of"),
    "clip": (lambda b: dict(clip_eps=2.0), "clip_eps must be < 1"),
    "too-long": (
        lambda b: dict(max_tokens_per_micro_batch=8),
        r"sequence 0 has 20 tokens .* raise max_tokens_per_micro_batch",
    ),
}


@pytest.mark.parametrize("case", list(BAD_STEP_INPUT))
def test_bad_step_input_is_refused_before_any_work(model, rl_cases, case):
    from megatron_hybrid.rl import PolicyTrainer

    change, match = BAD_STEP_INPUT[case]
    trainer = PolicyTrainer(model, optimizer="sgd", lr=LR, clip_grad=0.0)
    weights = {n: t.clone() for n, t in trainer.iter_hf_weights()}
    batch = rl_cases[FAMILY][0]
    with pytest.raises(ValueError, match=r"PolicyTrainer.step: " + match):
        trainer.step(batch.sequences, **_inputs(batch, **change(batch)))
    assert all(torch.equal(t, weights[n]) for n, t in trainer.iter_hf_weights())


def test_one_number_per_sequence_is_an_advantage_for_every_token(model, rl_cases):
    """GRPO's advantages: one per sequence, the same step as per-token copies."""
    from megatron_hybrid.hf.weights import model_chunks
    from megatron_hybrid.rl import PolicyTrainer

    trainer = PolicyTrainer(model, optimizer="sgd", lr=LR, clip_grad=0.0)
    params = [p for chunk in model_chunks(model) for p in chunk.parameters()]
    start = [p.detach().clone() for p in params]
    batch = rl_cases[FAMILY][0]
    scalars = [float(a[0]) for a in batch.advantages]
    trainer.step(batch.sequences, **_inputs(batch, advantages=scalars))
    one = [p.detach().clone() for p in params]
    with torch.no_grad():
        for param, value in zip(params, start, strict=True):
            param.copy_(value)
    copies = [torch.full_like(a, s) for a, s in zip(batch.advantages, scalars, strict=True)]
    trainer.step(batch.sequences, **_inputs(batch, advantages=copies))
    assert all(torch.equal(a, b) for a, b in zip(one, params, strict=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(optimizer="adamw", lr=1.0), "optimizer='adamw': choose one of adam, sgd"),
        (dict(lr=-1.0), "lr must be a finite number >= 0"),
        (dict(lr=1.0, temperature=0.0), "temperature must be a positive finite number"),
    ],
    ids=["optimizer", "lr", "temperature"],
)
def test_bad_settings_are_refused(model, kwargs, match):
    from megatron_hybrid.rl import PolicyTrainer

    with pytest.raises(ValueError, match=match):
        PolicyTrainer(model, **kwargs)


def test_a_wrapped_model_is_refused(model):
    from megatron_hybrid.rl import PolicyTrainer

    trainer = PolicyTrainer(model, lr=1.0)
    with pytest.raises(ValueError, match="already wrapped in DistributedDataParallel"):
        PolicyTrainer(trainer.chunks[0], lr=1.0)

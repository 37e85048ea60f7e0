"""transformers as the oracle of ``PolicyTrainer.step``: the same loss's gradient, in float32.

:func:`transformers_gradients` evaluates the policy loss on transformers' float32 model of a
tiny random Hugging Face folder (every sequence alone, no packing, eager attention and experts),
written out here independently of ``megatron_hybrid.rl.losses``: a padded ``[sequences, tokens]``
loss matrix aggregated as verl's ``agg_loss`` defines the modes (verl,
``verl/trainer/ppo/core_algos.py``). Its gradients come back in the folder's on-disk names (the
model holding them is written with ``save_pretrained``, whose layout conversion is linear), the
names ``iter_hf_weights`` streams, so one ``sgd`` step of the trainer must move every streamed
tensor by ``-lr`` times them.

The bound (:func:`bound`) comes from the computation: both sides are float32 evaluations of the
same function, whose rounding errors grow with the gradient's scale ``G`` (its largest entry
anywhere) times float32's epsilon times a depth factor ``16 x (decoder layers + 2)`` (embedding
and head), plus the rounding of the update itself (``eps x |w| / lr``).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import hf_oracle
import torch

LR = 1.0
EPS32 = 2.0**-23

#: name -> (transformers family, tiny-config overrides): a dense transformer (four layers: two
#: pipeline stages of two virtual stages each), MoE experts, and GatedDeltaNet next to attention.
FAMILIES = {
    "dense": ("qwen3_5", dict(num_hidden_layers=4, layer_types=["full_attention"] * 4)),
    "moe": ("qwen3_5_moe", dict(num_hidden_layers=2, layer_types=["full_attention"] * 2)),
    "gdn": ("qwen3_5", dict(num_hidden_layers=2, layer_types=[
        "linear_attention", "full_attention"])),
}  # fmt: skip

#: Sequence lengths of the global batch: with 24 tokens per micro-batch they make micro-batches
#: of different loss-masked token counts ([20], [16, 7], [13, 9], [5]); sequence 3 has no
#: loss-masked token (left out of the sequence means).
LENGTHS = (20, 7, 13, 5, 16, 9)
MAX_TOKENS = 24


@dataclass(frozen=True)
class Variant:
    """One step's loss settings (``PolicyTrainer.step`` keywords)."""

    loss_agg: str
    terms: bool  # old log-probs, a reference, KL and entropy terms, clip-higher

    @property
    def name(self) -> str:
        return f"{self.loss_agg}{'+kl+entropy' if self.terms else ''}"

    def step_kwargs(self, batch: Batch, index=None) -> dict:
        pick = (lambda values: values) if index is None else (lambda v: [v[i] for i in index])
        kwargs = dict(
            loss_masks=pick(batch.loss_masks),
            advantages=pick(batch.advantages),
            loss_agg=self.loss_agg,
            max_tokens_per_micro_batch=MAX_TOKENS,
        )
        if self.terms:
            kwargs.update(
                old_logprobs=pick(batch.old),
                ref_logprobs=pick(batch.ref),
                clip_eps=0.2,
                clip_eps_high=0.28,
                kl_coef=0.1,
                entropy_coef=0.05,
            )
        return kwargs


VARIANTS = tuple(
    Variant(mode, terms)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    for terms in (False, True)
)


@dataclass(frozen=True)
class Batch:
    """A global batch: sequences and their per-token inputs (entry j for token j + 1)."""

    sequences: list
    loss_masks: list
    advantages: list
    old: list
    ref: list


def hf_model(folder: Path, family: str):
    """transformers' float32 model of the folder (eager attention and experts), training mode."""
    hf_oracle.modeling_module(family)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).train()


def _logprobs_and_entropy(model, sequence: torch.Tensor):
    logits = model(input_ids=sequence[None], use_cache=False).logits[0].float()
    log_p = torch.log_softmax(logits, -1)[:-1]
    picked = log_p.gather(-1, sequence[1:, None]).squeeze(-1)
    return picked, -(log_p.exp() * log_p).sum(-1)


def make_batch(folder: Path, family: str, seed: int = 3) -> Batch:
    """Random sequences; loss masks on a suffix (none for sequence 3); advantages; old and
    reference log-probs a random distance from the model's (ratios 0.4 to 2.5: the clips bind)."""
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, 256, (n,), generator=gen) for n in LENGTHS]
    model = hf_model(folder, family)
    with torch.no_grad():
        current = [_logprobs_and_entropy(model, s)[0] for s in sequences]
    masks = []
    for i, n in enumerate(LENGTHS):
        mask = torch.zeros(n - 1)
        mask[n // 3 :] = 0.0 if i == 3 else 1.0
        masks.append(mask)
    return Batch(
        sequences=sequences,
        loss_masks=masks,
        advantages=[torch.randn(n - 1, generator=gen) for n in LENGTHS],
        old=[lp + 0.3 * torch.randn(lp.shape, generator=gen) for lp in current],
        ref=[lp + 0.5 * torch.randn(lp.shape, generator=gen) for lp in current],
    )


def policy_loss(model, batch: Batch, variant: Variant) -> torch.Tensor:
    """The loss of the whole batch under transformers' model (see the module doc)."""
    width = max(LENGTHS) - 1
    losses = torch.zeros(len(LENGTHS), width)
    mask = torch.zeros(len(LENGTHS), width)
    for i, sequence in enumerate(batch.sequences):
        logp, entropy = _logprobs_and_entropy(model, sequence)
        advantage = batch.advantages[i]
        old = batch.old[i] if variant.terms else logp.detach()
        ratio = torch.exp(logp - old)
        low, high = (0.8, 1.28) if variant.terms else (0.8, 1.2)
        loss = -torch.minimum(ratio * advantage, torch.clamp(ratio, low, high) * advantage)
        if variant.terms:
            delta = batch.ref[i] - logp
            loss = loss + 0.1 * (torch.exp(delta) - delta - 1) - 0.05 * entropy
        n = len(sequence) - 1
        losses[i, :n] = loss
        mask[i, :n] = batch.loss_masks[i]
    if variant.loss_agg == "token-mean":
        return (losses * mask).sum() / mask.sum()
    counts = mask.sum(-1)
    sums = (losses * mask).sum(-1)
    per_sequence = sums if variant.loss_agg == "seq-mean-token-sum" else sums / (counts + 1e-8)
    kept = (counts > 0).float()
    return (per_sequence * kept).sum() / kept.sum()


def transformers_gradients(folder: Path, family: str, batch: Batch, variant: Variant):
    """``(loss, {on-disk name: gradient})`` of the policy loss under transformers."""
    model = hf_model(folder, family)
    loss = policy_loss(model, batch, variant)
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.grad.detach().clone()
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        grads = hf_oracle.read_tensors(out)
    return float(loss.detach()), {name: g.double() for name, g in grads.items()}


def bound(grads: dict, weights: dict) -> float:
    """The largest allowed ``|step / -lr - gradient|`` (see the module doc)."""
    scale = max(g.abs().max().item() for g in grads.values())
    largest = max(w.abs().max().item() for w in weights.values())
    layers = 1 + max(int(n.split(".")[2]) for n in grads if n.startswith("model.layers."))
    return 16 * (layers + 2) * EPS32 * scale + EPS32 * largest / LR


def worst_error(deltas: dict, grads: dict) -> float:
    """``max |delta - gradient|`` over every tensor; the names must be the same sets."""
    assert set(deltas) == set(grads), set(deltas) ^ set(grads)
    worst = 0.0
    for name, grad in grads.items():
        delta = torch.as_tensor(deltas[name]).double()
        assert delta.shape == grad.shape, name
        worst = max(worst, (delta - grad).abs().max().item())
    assert math.isfinite(worst)
    return worst


#: Greedy decoding: prompt lengths, tokens generated, and the smallest top-two logit margin of
#: transformers at which a step is compared (our logits are within about 1e-6 of its).
PROMPTS = (5, 9, 3)
NEW_TOKENS = 8
MARGIN = 1e-4


def prompts():
    """The prompts of the greedy comparisons."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=gen) for n in PROMPTS]


def transformers_greedy(folder, family):
    """Per prompt: ``(generated tokens, leading steps whose top-two margin is >= MARGIN)``."""
    model = hf_model(folder, family).eval()
    out = []
    for prompt in prompts():
        result = model.generate(
            prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # token 0 is no pad
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        margins = [float(s[0].topk(2).values.diff().abs()) for s in result.scores]
        clear = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
        out.append((result.sequences[0, len(prompt) :], clear))
    return out


def assert_greedy_matches(got, want, where):
    """Our tokens equal transformers' while its margins are clear (at least half of them)."""
    for i, (tokens, (reference, clear)) in enumerate(zip(got, want, strict=True)):
        assert len(tokens) == NEW_TOKENS, where
        assert clear >= NEW_TOKENS // 2, (where, i, clear)  # the comparison is not vacuous
        assert tokens[:clear].tolist() == reference[:clear].tolist(), (where, i)

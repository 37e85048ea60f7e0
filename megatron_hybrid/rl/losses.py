"""The policy-gradient loss of :class:`~megatron_hybrid.rl.PolicyTrainer`, as pure tensor math.

Per loss-masked token ``t`` of a sequence, with ``r = exp(logp - old)`` (``old``: the log-probs
the samples were drawn with; this step's detached log-probs when not given, so ``r = 1``):

    loss_t = -min(r * A, clip(r, 1 - clip_eps, 1 + clip_eps_high) * A)
             + kl_coef * (exp(ref - logp) - (ref - logp) - 1)
             - entropy_coef * entropy_t

(PPO's clipped surrogate with verl's ``clip_ratio_low``/``clip_ratio_high``; the KL term is the
``k3`` estimator verl calls ``low_var_kl``, unclamped.) The tokens' losses are aggregated over the
whole global batch (every micro-batch and data-parallel rank) as verl's ``agg_loss`` does
(verl, ``verl/trainer/ppo/core_algos.py``, ``agg_loss``):

* ``"token-mean"``: the sum over every loss-masked token, divided by their number;
* ``"seq-mean-token-mean"``: each sequence's mean over its loss-masked tokens, averaged over the
  sequences that have any;
* ``"seq-mean-token-sum"``: each sequence's sum over its loss-masked tokens, averaged likewise.

Every mode is a weighted sum divided by a count: :func:`sequence_weights` gives a sequence's
per-token weights and its share of the count, so a micro-batch's loss is ``sum(w * loss_t)``
with its count, and megatron's per-token-loss schedule divides the global sum by the global count
(``docs/user_guide.md``, "Use it from an RL framework"). Nothing here imports megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "LOSS_AGGREGATIONS",
    "PolicyLoss",
    "TokenTerms",
    "aggregate",
    "sequence_weights",
    "token_terms",
]

#: The ``loss_agg`` modes (verl's ``loss_agg_mode`` names).
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _number(name: str, value, *, low: float = 0.0, strict: bool = False) -> float:
    """``value`` as a float, or ValueError unless it is a finite number >= ``low`` (> if strict)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or (strict and value == low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value}")
    return float(value)


@dataclass(frozen=True)
class PolicyLoss:
    """The coefficients of one step's loss (``PolicyTrainer.step``'s keywords), checked.

    Attributes:
        clip_eps: the ratio's lower clip, ``1 - clip_eps`` (and the upper one unless
            ``clip_eps_high`` is given).
        clip_eps_high: the upper clip ``1 + clip_eps_high`` (DAPO's clip-higher), or None.
        kl_coef: weight of the KL penalty to the reference policy (needs ``ref_logprobs``).
        entropy_coef: weight of the entropy bonus.
        loss_agg: one of :data:`LOSS_AGGREGATIONS`.
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"

    def __post_init__(self) -> None:
        _number("clip_eps", self.clip_eps, strict=True)
        if self.clip_eps >= 1:
            raise ValueError(
                f"clip_eps must be < 1 (the lower clip is 1 - clip_eps), got {self.clip_eps}"
            )
        if self.clip_eps_high is not None:
            _number("clip_eps_high", self.clip_eps_high, strict=True)
        _number("kl_coef", self.kl_coef)
        _number("entropy_coef", self.entropy_coef)
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(
                f"loss_agg={self.loss_agg!r}: choose one of {', '.join(LOSS_AGGREGATIONS)}"
            )

    @property
    def upper_clip(self) -> float:
        """``1 + (clip_eps_high or clip_eps)``."""
        return 1.0 + (self.clip_eps if self.clip_eps_high is None else self.clip_eps_high)


@dataclass(frozen=True)
class TokenTerms:
    """Per-token pieces of the loss (tensors of one shape).

    Attributes:
        policy: the clipped surrogate ``-min(r A, clip(r) A)``.
        kl: ``exp(ref - logp) - (ref - logp) - 1`` (zeros without a reference).
        entropy: the entropy (zeros when not computed).
        clipped: 1.0 where the clipped term is the one taken (it is larger than ``-r A``).
    """

    policy: Tensor
    kl: Tensor
    entropy: Tensor
    clipped: Tensor

    def loss(self, settings: PolicyLoss) -> Tensor:
        """``policy + kl_coef * kl - entropy_coef * entropy`` per token."""
        total = self.policy
        if settings.kl_coef:
            total = total + settings.kl_coef * self.kl
        if settings.entropy_coef:
            total = total - settings.entropy_coef * self.entropy
        return total


def token_terms(
    logprobs: Tensor,
    advantages: Tensor,
    settings: PolicyLoss,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> TokenTerms:
    """The loss's per-token pieces from this step's (differentiable) log-probs.

    Args:
        logprobs: ``logp`` of the sampled tokens under the current weights.
        advantages: ``A`` per token.
        settings: the coefficients.
        old_logprobs: the log-probs the tokens were sampled with (None: ``logp`` detached).
        ref_logprobs: the reference policy's log-probs (None: no KL term).
        entropy: the entropy at each position (None: zeros).
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.clip_eps, settings.upper_clip)
    zeros = torch.zeros_like(logprobs)
    if ref_logprobs is None:
        kl = zeros
    else:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
    return TokenTerms(
        policy=torch.maximum(unclipped, clipped),
        kl=kl,
        entropy=zeros if entropy is None else entropy,
        clipped=(clipped > unclipped).to(logprobs.dtype),
    )


def sequence_weights(loss_mask: Tensor, loss_agg: str) -> tuple[Tensor, int]:
    """One sequence's per-token weights and its share of the global count under ``loss_agg``.

    The global loss is ``sum over sequences of sum(weights * loss_t)`` divided by the sum of
    the counts: ``token-mean`` weighs each loss-masked token 1 and counts it; the sequence
    means weigh a sequence's ``n`` loss-masked tokens ``1 / n`` (``token-mean`` within it) or 1
    (``token-sum``) and count the sequence once; a sequence without loss-masked tokens weighs
    nothing and counts nothing (verl's ``seq_mask``).

    Args:
        loss_mask: 0/1 (or bool) per token.
        loss_agg: one of :data:`LOSS_AGGREGATIONS`.

    Returns:
        ``(weights as float32, count)``.
    """
    mask = loss_mask.to(torch.float32)
    tokens = int(mask.sum())
    if loss_agg == "token-mean":
        return mask, tokens
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg={loss_agg!r}: choose one of {', '.join(LOSS_AGGREGATIONS)}")
    if tokens == 0:
        return mask, 0
    return (mask / tokens if loss_agg == "seq-mean-token-mean" else mask), 1


def aggregate(losses: list[Tensor], loss_masks: list[Tensor], loss_agg: str) -> Tensor:
    """The global loss of per-sequence token losses (the whole batch in one place).

    What the trainer's micro-batches and data-parallel ranks compute together; zero when no
    token is loss-masked.
    """
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for loss, mask in zip(losses, loss_masks, strict=True):
        weights, share = sequence_weights(mask, loss_agg)
        total = total + (weights.to(loss.dtype) * loss).sum()
        count += share
    return total / max(count, 1)

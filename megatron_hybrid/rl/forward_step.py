"""What megatron-core's schedule calls in a policy step: the forward step and the loss function.

:class:`~megatron_hybrid.rl.PolicyTrainer` hands :func:`policy_forward_step` to
:func:`~megatron_hybrid.training.loop.train_step` as megatron's ``forward_step_func``, with
:func:`micro_batch_loss` bound to the step's settings. The loss function returns megatron's
per-token three-tuple ``(sum of weighted token losses, count, report)``, which the schedule sums
over micro-batches and ``finalize_model_grads`` divides by the count summed over every
data-parallel rank (megatron-core 0.19.2, ``pipeline_parallel/schedules.py``,
``forward_step_calc_loss``), so the loss is exact over the global batch. The per-token terms
are :mod:`megatron_hybrid.rl.losses`'; the log-probs and entropies come from the vocab-parallel
logits without gathering them (:func:`~megatron_hybrid.logprobs.vocab.token_logprobs_and_entropy`).
"""

from __future__ import annotations

from functools import partial

import torch

from megatron_hybrid.logprobs.forward import model_logits
from megatron_hybrid.logprobs.vocab import token_logprobs_and_entropy
from megatron_hybrid.rl.losses import PolicyLoss, token_terms

__all__ = ["POLICY_LOSS", "micro_batch_loss", "policy_forward_step"]

#: The report key of the policy loss (entries: loss sum, count, policy, KL and entropy sums,
#: clipped tokens, loss-masked tokens).
POLICY_LOSS = "policy loss"


def micro_batch_loss(batch: dict, output: torch.Tensor, *, settings: PolicyLoss, options: dict):
    """The loss function of one micro-batch (last pipeline stage): megatron's three-tuple.

    Args:
        batch: the micro-batch (:meth:`PolicyTrainer.step` builds it): ``labels`` and, per
            output row, ``mask``, ``weights`` (:func:`~megatron_hybrid.rl.losses.sequence_weights`),
            ``advantages`` and ``old``/``ref`` log-probs (or None); ``count``.
        output: this rank's vocab-parallel logits.
        settings: the loss's coefficients.
        options: ``tp_group``, ``temperature``, ``vocab_size`` of the vocab-parallel reduction.

    Returns:
        ``(sum of weights x token losses, count, {POLICY_LOSS: report})``.
    """
    logits = output.reshape(-1, output.size(-1))
    logp, entropy = token_logprobs_and_entropy(logits, batch["labels"], **options)
    mask = batch["mask"]
    live = mask > 0
    current = logp.detach()
    # Outside the loss mask the inputs may be anything (padding): there they become the values
    # that make every term zero with finite derivatives.
    old = None if batch["old"] is None else torch.where(live, batch["old"], current)
    ref = None if batch["ref"] is None else torch.where(live, batch["ref"], current)
    advantages = torch.where(live, batch["advantages"], torch.zeros_like(current))
    terms = token_terms(
        logp, advantages, settings, old_logprobs=old, ref_logprobs=ref, entropy=entropy
    )
    weights = batch["weights"]
    loss_sum = (weights * terms.loss(settings)).sum()
    count = batch["count"]
    report = torch.stack(
        [
            loss_sum.detach(),
            count.float(),
            (weights * terms.policy).sum().detach(),
            (weights * terms.kl).sum().detach(),
            (weights * terms.entropy).sum().detach(),
            (mask * terms.clipped).sum(),
            mask.sum(),
        ]
    )
    return loss_sum, count, {POLICY_LOSS: report}


def policy_forward_step(data_iterator, model, return_schedule_plan: bool = False, *, loss):
    """``forward_step_func`` of the policy step for megatron-core's schedules.

    Args:
        data_iterator: yields the micro-batch dicts :meth:`PolicyTrainer.step` builds.
        model: a model chunk.
        return_schedule_plan: refused (the combined-1F1B EP overlap schedule has no policy
            loss yet).
        loss: ``micro_batch_loss`` with the step's settings bound.
    """
    if return_schedule_plan:
        raise ValueError(
            "PolicyTrainer: overlap_moe_expert_parallel_comm is not supported; build the model "
            "without it"
        )
    batch = next(data_iterator)
    output = model_logits(model, batch, gather_output=False)  # reduced without gathering
    return output, partial(loss, batch)

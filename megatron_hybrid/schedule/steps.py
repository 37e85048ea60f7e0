"""The forward step that megatron-core's schedules call, for language-model batches.

A batch is a dict with ``input_ids``, ``labels``, ``loss_mask`` and ``position_ids`` (``[b, s]``)
and optionally ``attention_mask``, ``padding_mask`` (True = padding) and ``packed_seq_params``.
The loss function returns megatron's three-tuple (sum of token losses, token count, reporting
tensor), so the schedules average over tokens across micro-batches and data-parallel ranks
exactly as Megatron-LM's ``pretrain_gpt`` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

__all__ = ["LM_LOSS", "lm_forward_step", "masked_token_loss", "run_schedule"]

#: The report key of the language-model loss (Megatron-LM's name for it in its logs).
LM_LOSS = "lm loss"


def masked_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's loss-function contract: ``(loss_sum, num_tokens, {"lm loss": ...})``.

    Args:
        loss_mask: ``[b, s]``, 1 for tokens that count.
        output_tensor: per-token losses ``[b, s]`` from the model.

    Returns:
        The summed masked loss, the number of counted tokens, and a report tensor
        ``[loss_sum, num_tokens]`` that megatron's logging reduces over data-parallel ranks.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {LM_LOSS: report}


def lm_forward_step(data_iterator: Iterator, model, return_schedule_plan: bool = False):
    """``forward_step_func`` for megatron-core's ``get_forward_backward_func()``.

    Args:
        data_iterator: yields batch dicts (None on pipeline stages that do not read data).
        model: a model chunk (HybridModel or GPTModel, possibly wrapped).
        return_schedule_plan: return the combined-1F1B schedule plan instead of running the
            model (megatron calls this when ``overlap_moe_expert_parallel_comm`` is set).

    Returns:
        ``(output_tensor or schedule plan, loss function)``.
    """
    batch = next(data_iterator) if data_iterator is not None else None
    batch = batch or {}
    loss_mask = batch.get("loss_mask")
    kwargs = dict(
        input_ids=batch.get("input_ids"),
        position_ids=batch.get("position_ids"),
        attention_mask=batch.get("attention_mask"),
        labels=batch.get("labels"),
        loss_mask=loss_mask,
        packed_seq_params=batch.get("packed_seq_params"),
        padding_mask=batch.get("padding_mask"),
    )
    if return_schedule_plan:
        plan = model.build_schedule_plan(**kwargs)
        return plan, partial(masked_token_loss, loss_mask)
    output = model(**kwargs)
    return output, partial(masked_token_loss, loss_mask)


def run_schedule(
    chunks: list,
    batches: list,
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    forward_step=lm_forward_step,
    pg_collection=None,
) -> list[dict]:
    """Run ``batches`` through megatron-core's schedule over the model ``chunks``.

    One iterator of the micro-batches per chunk (a virtual pipeline stage reads its own), and
    megatron's calling convention: a list of models and iterators only for more than one chunk.

    Args:
        chunks: the model chunks, one per virtual pipeline stage.
        batches: the global batch's micro-batches, or one list of them per chunk.
        seq_length, micro_batch_size: the pipeline's tensor shape.
        forward_only: no backward pass.
        forward_step: megatron-core's ``forward_step_func`` (default: the language model's).
        pg_collection: the process groups to run over (the schedule is picked by their pipeline
            size and the number of chunks, and pipelines send through a ``P2PCommunicator`` of
            their own); None: megatron-core's global parallel state.

    Returns:
        The loss functions' reports (on the last pipeline stage; empty elsewhere).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    per_chunk = batches if batches and isinstance(batches[0], list) else [batches] * len(chunks)
    iterators = [iter(list(b)) for b in per_chunk]
    kwargs, schedule = {}, get_forward_backward_func
    if pg_collection is not None:
        pp = pg_collection.pp.size()
        kwargs["pg_collection"] = pg_collection
        if pp > 1:
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
            from megatron.core.utils import get_model_config

            kwargs["p2p_communicator"] = P2PCommunicator(
                pp_group=pg_collection.pp, config=get_model_config(chunks[0])
            )
        schedule = partial(get_forward_backward_func, pp_size=pp,
                           vp_size=len(chunks) if len(chunks) > 1 else None)  # fmt: skip
    return schedule()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(per_chunk[0]),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        **kwargs,
    )

"""``--eval-interval N --eval-iters K``: the loss on the validation split, forward only.

Every evaluation runs the same ``K`` global batches (the first ``K x global batch`` samples of the
validation split), so its values compare across a run and a resumed run repeats them exactly.
The loss is Megatron-LM's: the mean over every loss-counted token of the ``K`` batches (the
token sums of all micro-batches and data-parallel ranks, divided once).
"""

from __future__ import annotations

import torch

from megatron_hybrid.logprobs.forward import evaluating
from megatron_hybrid.schedule.steps import run_schedule

__all__ = ["evaluate"]


def evaluate(chunks, batches: list, config, *, seq_length: int, micro_batch_size: int, pg) -> float:
    """The mean validation loss over ``batches`` (one list of micro-batches per global batch).

    Collective over the world; every rank returns the same value.
    """
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    totals = torch.zeros(2, dtype=torch.float64)
    with evaluating(chunks):
        for global_batch in batches:
            reports = run_schedule(
                chunks, list(global_batch), seq_length=seq_length,
                micro_batch_size=micro_batch_size, forward_only=True,
            )  # fmt: skip
            for report in reports:  # the last pipeline stage's
                totals += report["lm loss"].double().cpu()
    totals = totals.to(device)
    torch.distributed.all_reduce(totals, group=pg.dp_cp)
    torch.distributed.all_reduce(totals, group=pg.pp)  # only the last stage adds
    return float(totals[0] / totals[1].clamp(min=1))

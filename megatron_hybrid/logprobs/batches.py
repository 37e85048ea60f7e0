"""Micro-batches for :func:`~megatron_hybrid.logprobs.forward_logprobs`: packed or padded rows.

Sequences go into micro-batches of at most ``max_tokens`` tokens (after alignment), first fit in
order of decreasing length; a sequence of ``n`` tokens is ``n - 1`` inputs (its last token only
is a label). The micro-batches themselves are the package's one layout of padded and packed
rows (:func:`megatron_hybrid.data.batches.build_micro_batch`): a packed one is one THD row, a
padded one ``[B, S]`` rows, and each records, for every sequence in it, which rows of the
model's flattened ``[b * s, vocab]`` output predict its tokens, and the label of every row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_hybrid.data.batches import MicroBatch, build_micro_batch
from megatron_hybrid.data.samples import TokenSample
from megatron_hybrid.padding import PaddingConfig

__all__ = ["MicroBatch", "dummy_micro_batch", "micro_batch_groups", "sequences_batch"]


def _aligned_budget(padding: PaddingConfig, max_tokens: int) -> tuple[int, int, int]:
    """``(per-sequence multiple s, total multiple t, usable tokens)`` of a packed micro-batch."""
    probe = padding.thd([1])
    s, t = probe.seq_multiple, probe.total_multiple
    return s, t, max_tokens // t * t


def micro_batch_groups(
    lengths: Sequence[int], padding: PaddingConfig, max_tokens: int, packed: bool, rows: int | None
) -> list[list[int]]:
    """Sequence indices of each micro-batch (first fit, longest first).

    Args:
        lengths: input tokens of each sequence to run (its length minus one).
        padding: the model's padding settings.
        max_tokens: tokens per micro-batch after alignment.
        packed: THD rows (True) or padded rows.
        rows: a fixed number of padded rows per micro-batch (each then holds one sequence), or
            None.

    Raises:
        ValueError: a sequence does not fit in ``max_tokens`` once aligned.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if packed:
        s, t, budget = _aligned_budget(padding, max_tokens)
        need = {i: -(-lengths[i] // s) * s for i in order}
        too_long = [i for i in order if need[i] > budget]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"sequence {i} has {lengths[i] + 1} tokens ({need[i]} inputs after aligning to "
                f"{s}) but a "
                f"micro-batch holds at most {budget} (max_tokens_per_micro_batch={max_tokens} "
                f"rounded down to a multiple of {t}, the packing alignment); raise "
                "max_tokens_per_micro_batch"
            )
        groups: list[list[int]] = []
        used: list[int] = []
        for i in order:
            slot = next((g for g, u in enumerate(used) if u + need[i] <= budget), None)
            if slot is None:
                groups.append([i])
                used.append(need[i])
            else:
                groups[slot].append(i)
                used[slot] += need[i]
        return [sorted(g) for g in groups]
    rows_each = rows or 1
    groups, current = [], []
    for i in order:  # longest first: the first row of a micro-batch sets its padded length
        if current:
            grown = current + [i]
            width = padding.bshd(cur_len=lengths[current[0]], batch_size=len(grown)).padded_len
            if rows is None and len(grown) * width <= max_tokens:
                current = grown
                continue
            groups.append(current)
        width = padding.bshd(cur_len=lengths[i], batch_size=rows_each).padded_len
        if rows_each * width > max_tokens:
            raise ValueError(
                f"sequence {i} has {lengths[i] + 1} tokens ({rows_each} x {width} inputs after "
                "alignment) "
                f"but a micro-batch holds at most max_tokens_per_micro_batch={max_tokens}; "
                "raise it"
            )
        current = [i]
    return groups + [current]


def sequences_batch(
    tokens: Sequence[torch.Tensor],
    indices: Sequence[int],
    padding: PaddingConfig,
    *,
    packed: bool,
    fixed_length: int | None = None,
    rows: int | None = None,
    equalize_group=None,
) -> MicroBatch:
    """The micro-batch of ``tokens[i]`` for ``i`` in ``indices`` (CPU tensors), built by
    :func:`megatron_hybrid.data.batches.build_micro_batch`; its spans name the sequences by
    their index in ``tokens``.

    Args:
        tokens: every sequence's token ids (each at least 2: one predicts nothing).
        indices: the sequences of this micro-batch.
        padding: the model's padding settings.
        packed: one THD row, or padded rows.
        fixed_length: a fixed ``T`` (packed) or ``S`` (padded), or None.
        rows: a fixed row count (padded), or None.
        equalize_group: the TP x EP group whose HybridEP counts must match (one all-reduce).
    """
    indices = list(indices)
    batch = build_micro_batch(
        [TokenSample(tokens[i]) for i in indices],
        padding,
        packed=packed,
        fixed_length=fixed_length,
        rows=rows,
        equalize_group=equalize_group,
    )
    batch.spans = [(indices[sample], first, count) for sample, first, count in batch.spans]
    return batch


def dummy_micro_batch(padding: PaddingConfig, **kwargs) -> MicroBatch:
    """A one-token micro-batch whose output is discarded (keeps ranks' micro-batch counts equal)."""
    batch = sequences_batch([torch.zeros(2, dtype=torch.long)], [0], padding, **kwargs)
    batch.spans = []
    return batch

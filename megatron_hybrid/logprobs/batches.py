"""Micro-batches for :func:`~megatron_hybrid.logprobs.forward_logprobs`: packed or padded rows.

Sequences go into micro-batches of at most ``max_tokens`` tokens (after alignment), first fit in
order of decreasing length. A packed micro-batch is one THD row planned by
:meth:`~megatron_hybrid.padding.PaddingConfig.thd` (so TP/SP, CP, FP8 and HybridEP alignment
hold); a padded one is ``[B, S]`` rows planned by
:meth:`~megatron_hybrid.padding.PaddingConfig.bshd`.
Each micro-batch also records, for every sequence in it, which rows of the model's flattened
``[b * s, vocab]`` output predict its tokens, and the label of every row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_hybrid.padding import PaddingConfig, equalize_bshd, equalize_thd, pack_thd, pad_bshd

__all__ = ["MicroBatch", "micro_batch_groups", "build_micro_batch", "dummy_micro_batch"]

PAD_TOKEN_ID = 0


@dataclass
class MicroBatch:
    """One model input and where each sequence's predictions are in its output.

    Attributes:
        inputs: keyword arguments of the model's forward (tokens, positions, masks, THD params).
        labels: ``[b * s]`` next-token label of every output row (0 where a row predicts nothing).
        spans: ``(sequence index, first output row, number of predictions)`` per sequence.
        seq_length: the row length the pipeline schedule sees (``T`` packed, ``S`` padded).
        rows: ``b`` (1 when packed).
        results: filled by the last pipeline stage: sequence index -> per-token tensors.
    """

    inputs: dict
    labels: torch.Tensor
    spans: list[tuple[int, int, int]]
    seq_length: int
    rows: int
    results: dict = field(default_factory=dict)


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
        lengths: token count of each sequence to run.
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
                f"sequence {i} has {lengths[i]} tokens ({need[i]} after aligning to {s}) but a "
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
                f"sequence {i} has {lengths[i]} tokens ({rows_each} x {width} after alignment) "
                f"but a micro-batch holds at most max_tokens_per_micro_batch={max_tokens}; "
                "raise it"
            )
        current = [i]
    return groups + [current]


def _thd(tokens, indices, padding, force_total, equalize_group):
    plan = padding.thd([len(tokens[i]) for i in indices], force_total=force_total)
    if equalize_group is not None and padding.needs_group_equalize:
        plan = equalize_thd(plan, equalize_group)
    packed = pack_thd([{"input_ids": tokens[i]} for i in indices], plan, pad_token_id=PAD_TOKEN_ID)
    labels = torch.zeros(plan.total_tokens, dtype=torch.long)
    spans = []
    for i, start in zip(indices, plan.cu_seqlens_padded, strict=False):
        n = len(tokens[i]) - 1
        labels[start : start + n] = tokens[i][1:]
        spans.append((i, start, n))
    inputs = dict(
        input_ids=packed.tensors["input_ids"],
        position_ids=packed.tensors["position_ids"],
        padding_mask=packed.tensors["padding_mask"],
        packed_seq_params=packed.packed_seq_params,
    )
    return MicroBatch(inputs, labels, spans, plan.total_tokens, 1)


def _bshd(tokens, indices, padding, force_len, rows, equalize_group):
    lengths = [len(tokens[i]) for i in indices]
    count = rows or len(indices)
    longest = max(lengths)
    plan = padding.bshd(cur_len=longest, batch_size=count, force_len=force_len)
    if equalize_group is not None and padding.needs_group_equalize:
        plan = equalize_bshd(plan, equalize_group)
    batch = torch.full((count, longest), PAD_TOKEN_ID, dtype=torch.long)
    real = [0] * count
    for row, i in enumerate(indices):
        batch[row, : lengths[row]] = tokens[i]
        real[row] = lengths[row]
    positions = torch.arange(longest).expand(count, -1).contiguous()
    padded = pad_bshd(
        dict(input_ids=batch, position_ids=positions), plan, pad_token_id=PAD_TOKEN_ID, lengths=real
    ).tensors
    width = plan.padded_len
    labels = torch.zeros(count, width, dtype=torch.long)
    spans = []
    for row, i in enumerate(indices):
        labels[row, : lengths[row] - 1] = tokens[i][1:]
        spans.append((i, row * width, lengths[row] - 1))
    inputs = dict(
        input_ids=padded["input_ids"],
        position_ids=padded["position_ids"],
        padding_mask=padded["padding_mask"],
        packed_seq_params=None,
    )
    return MicroBatch(inputs, labels.view(-1), spans, width, count)


def build_micro_batch(
    tokens: Sequence[torch.Tensor],
    indices: Sequence[int],
    padding: PaddingConfig,
    *,
    packed: bool,
    fixed_length: int | None = None,
    rows: int | None = None,
    equalize_group=None,
) -> MicroBatch:
    """The micro-batch of ``tokens[i]`` for ``i`` in ``indices`` (CPU tensors).

    Args:
        tokens: every sequence's token ids.
        indices: the sequences of this micro-batch.
        padding: the model's padding settings.
        packed: one THD row, or padded rows.
        fixed_length: a fixed ``T`` (packed) or ``S`` (padded) the pipeline needs, or None.
        rows: a fixed row count (padded), or None.
        equalize_group: the TP x EP group whose HybridEP counts must match (one all-reduce).
    """
    if packed:
        return _thd(tokens, list(indices), padding, fixed_length, equalize_group)
    return _bshd(tokens, list(indices), padding, fixed_length, rows, equalize_group)


def dummy_micro_batch(padding: PaddingConfig, **kwargs) -> MicroBatch:
    """A one-token micro-batch whose output is discarded (keeps ranks' micro-batch counts equal)."""
    batch = build_micro_batch([torch.zeros(1, dtype=torch.long)], [0], padding, **kwargs)
    batch.spans = []
    return batch

"""Micro-batches for :func:`~megatron_hybrid.logprobs.forward_logprobs` and the RL trainer's step:
packed or padded rows, planned over every rank.

Sequences go into micro-batches of at most ``max_tokens`` tokens (after alignment), first fit in
order of decreasing length. A packed micro-batch is one THD row planned by
:meth:`~megatron_hybrid.padding.PaddingConfig.thd` (so TP/SP, CP, FP8 and HybridEP alignment
hold); a padded one is ``[B, S]`` rows planned by
:meth:`~megatron_hybrid.padding.PaddingConfig.bshd`.
Each micro-batch also records, for every sequence in it, which rows of the model's flattened
``[b * s, vocab]`` output predict its tokens, and the label of every row.

:func:`plan_micro_batches` is the whole plan of one call on one rank: the sequences' micro-batches
(a fixed row length under pipeline parallelism) and dummy micro-batches so that every rank runs
as many as the busiest one (expert parallelism spans data-parallel replicas). The checks before
it (:func:`check_sequences`, :func:`replica_error`) and :func:`agree` make a bad input on any rank
an error on every rank before the forward pass, so no rank is left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_hybrid.padding import PaddingConfig, equalize_bshd, equalize_thd, pack_thd, pad_bshd

__all__ = [
    "MicroBatch",
    "agree",
    "build_micro_batch",
    "check_sequences",
    "dummy_micro_batch",
    "micro_batch_groups",
    "plan_micro_batches",
    "replica_error",
    "world_max",
]

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
        results: filled by the last pipeline stage: ``[parts, predictions]``, the per-token
            values of the spans' rows in span order (None until then).
    """

    inputs: dict
    labels: torch.Tensor
    spans: list[tuple[int, int, int]]
    seq_length: int
    rows: int
    results: torch.Tensor | None = None

    @property
    def span_rows(self) -> torch.Tensor:
        """Output rows of every span, in span order (CPU int64)."""
        if not self.spans:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(first, first + n) for _, first, n in self.spans])


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


def check_sequences(sequences, vocab: int) -> tuple[str | None, list[torch.Tensor]]:
    """The first problem with ``sequences`` (or None) and the sequences as CPU int64 tensors."""
    if torch.is_tensor(sequences) or not isinstance(sequences, Sequence):
        return "sequences must be a list of 1-D token tensors", []
    if not sequences:
        return "sequences is empty: pass at least one sequence of token ids", []
    tokens = []
    for i, seq in enumerate(sequences):
        t = seq if torch.is_tensor(seq) else torch.as_tensor(seq)
        if t.dtype.is_floating_point or t.is_complex() or t.dtype == torch.bool or t.dim() != 1:
            return f"sequence {i} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}", []
        if t.numel() == 0:
            return f"sequence {i} is empty (0 tokens); every sequence needs at least one", []
        tokens.append(t.detach().to("cpu", torch.long))
    flat = torch.cat(tokens)
    if int(flat.min()) < 0 or int(flat.max()) >= vocab:  # one check for all, then find where
        for i, t in enumerate(tokens):
            bad = ((t < 0) | (t >= vocab)).nonzero()
            if bad.numel():
                at = int(bad[0])
                return (
                    f"sequence {i} holds token id {int(t[at])} at position {at}, outside the "
                    f"vocabulary [0, {vocab})"
                ), []
    return None, tokens


def agree(error: str | None, device, where: str) -> None:
    """Raise on every rank if any rank found an error (no rank waits in a collective).

    Args:
        error: this rank's error message, or None.
        device: where the flag's all-reduce runs.
        where: the caller's name, which starts the message.
    """
    flag = torch.tensor([0.0 if error is None else 1.0], device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if error is not None:
        raise ValueError(f"{where}: {error}")
    if flag.item():
        raise ValueError(
            f"{where}: another rank refused its input (see that rank's error); every rank must "
            "pass valid input"
        )


def replica_error(tokens: list[torch.Tensor], group, device) -> str | None:
    """Why the ranks of one model replica (``group``: tensor x pipeline parallel) disagree about
    the sequences, or None (they compare a digest of every token and position)."""
    if group is None or group.size() == 1:
        return None
    lengths = torch.tensor([len(t) for t in tokens])
    flat = torch.cat(tokens)
    starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    position = torch.arange(len(flat)) - starts + 1
    which = torch.repeat_interleave(torch.arange(len(tokens)), lengths) + 1
    digest = int(((flat * position) % 1_000_003 * which % 1_000_033).sum())
    sizes = (len(tokens), len(flat), digest)
    mix = torch.tensor(sizes, dtype=torch.float64, device=device)
    low, high = mix.clone(), mix.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN, group=group)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        return (
            "the ranks of one model replica (tensor and pipeline parallel) passed different "
            "sequences; every rank of a replica must pass the same list"
        )
    return None


def world_max(values: list[int], device) -> list[int]:
    """Each value's maximum over every rank (the values themselves without a process group)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def _fixed_length(padding, lengths, max_tokens, packed, device) -> int:
    """The one row length every micro-batch has under pipeline parallelism."""
    if packed:
        probe = padding.thd([1])
        return max(probe.total_multiple, max_tokens // probe.total_multiple * probe.total_multiple)
    longest = world_max([max(lengths, default=1)], device)[0]
    return padding.align_seq_length(longest, micro_batch_size=1, force_policy="round_up")


def plan_micro_batches(
    tokens: Sequence[torch.Tensor],
    padding: PaddingConfig,
    *,
    max_tokens: int,
    packed: bool,
    pg_collection,
    chunks: int,
    device,
    where: str,
) -> list[MicroBatch]:
    """Every micro-batch this rank runs for ``tokens`` (collective over the world).

    Sequences of one token predict nothing and run in no micro-batch. Under pipeline
    parallelism every micro-batch has one row length; every rank runs as many micro-batches as
    the busiest one (dummies whose output nobody reads), a whole number of pipeline rounds
    under interleaving (``chunks`` > 1).

    Raises:
        ValueError: on every rank, if a sequence does not fit ``max_tokens`` on any rank.
    """
    runnable = [i for i, t in enumerate(tokens) if len(t) > 1]
    lengths = [len(tokens[i]) for i in runnable]
    pipelined = padding.fixed_length_required
    rows = 1 if not packed and (pipelined or padding.needs_group_equalize) else None
    fixed = _fixed_length(padding, lengths, max_tokens, packed, device) if pipelined else None
    try:
        groups = micro_batch_groups(lengths, padding, max_tokens, packed, rows) if lengths else []
        groups = [[runnable[i] for i in group] for group in groups]
        error = None
    except ValueError as refused:
        groups, error = [], str(refused)
    agree(error, device, where)
    count = world_max([len(groups)], device)[0]
    if chunks > 1:
        pp = pg_collection.pp.size()
        count = -(-count // pp) * pp  # interleaving needs whole rounds
    options = dict(packed=packed, fixed_length=fixed, rows=rows, equalize_group=pg_collection.tp_ep)
    batches = [build_micro_batch(tokens, group, padding, **options) for group in groups]
    return batches + [dummy_micro_batch(padding, **options) for _ in range(count - len(groups))]

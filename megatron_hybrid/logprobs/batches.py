"""Micro-batches for :func:`~megatron_hybrid.logprobs.forward_logprobs`: packed or padded rows.

Sequences go into micro-batches of at most ``max_tokens`` tokens (after alignment), first fit in
order of decreasing length; a sequence of ``n`` tokens is ``n - 1`` inputs (its last token only
is a label). The micro-batches themselves are the package's one layout of padded and packed
rows (:func:`megatron_hybrid.data.batches.build_micro_batch`): a packed one is one THD row, a
padded one ``[B, S]`` rows, and each records, for every sequence in it, which rows of the
model's flattened ``[b * s, vocab]`` output predict its tokens, and the label of every row.

:func:`plan_micro_batches` is the whole plan of one call on one rank: the sequences' micro-batches
(a fixed row length under pipeline parallelism) and dummy micro-batches so that every rank runs
as many as the busiest one (expert parallelism spans data-parallel replicas). The checks before
it (:func:`check_sequences`, :func:`replica_error`) and :func:`agree` make a bad input on any rank
an error on every rank before the forward pass, so no rank is left waiting in a collective.
``forward_logprobs``, ``PolicyTrainer`` and ``sample`` plan their micro-batches here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_hybrid.data.batches import MicroBatch, build_micro_batch
from megatron_hybrid.data.samples import TokenSample
from megatron_hybrid.padding import PaddingConfig
from megatron_hybrid.padding.batch import per_segment, segment_offsets

__all__ = [
    "MicroBatch",
    "agree",
    "check_sequences",
    "dummy_micro_batch",
    "micro_batch_groups",
    "plan_micro_batches",
    "replica_error",
    "sequences_batch",
    "world_max",
]


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
    lengths = [len(t) for t in tokens]
    flat = torch.cat(tokens).cpu()
    # Each token's position in its sequence and its sequence's number, both from 1 (per_segment:
    # torch's CPU repeat_interleave costs a parallel region per call).
    position = segment_offsets(lengths) + 1
    which = per_segment(range(1, len(tokens) + 1), lengths)
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
    runnable = [i for i, t in enumerate(tokens) if len(t) > 1]  # one token predicts nothing
    lengths = [len(tokens[i]) - 1 for i in runnable]  # inputs: the last token is a label only
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
    batches = [sequences_batch(tokens, group, padding, **options) for group in groups]
    return batches + [dummy_micro_batch(padding, **options) for _ in range(count - len(groups))]

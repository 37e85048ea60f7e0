"""The one builder of model-ready micro-batches: padded ``[B, S]`` rows or one packed THD row.

``train`` (synthetic and real data) and :func:`~megatron_hybrid.logprobs.forward_logprobs`
build their micro-batches here, through the padding planners (so TP/SP, CP, FP8 and HybridEP
alignment hold) and appliers of :mod:`megatron_hybrid.padding`:

- **padded** (BSHD): one row per sample, its document pieces side by side (as Megatron-LM's
  ``GPTDataset`` rows are: position ids run on, attention crosses the pieces), padded after the
  longest row or to a fixed length;
- **packed** (THD): one ``[1, T]`` row in which every document piece is a sequence of its own
  (``cu_seqlens``; position ids restart), each padded to the per-sequence multiple; ``T`` is the
  least aligned total or a fixed token budget (the tail is padding), so that every micro-batch
  of a run can have the same shape.

A sample's inputs are ``tokens[:-1]`` and its labels ``tokens[1:]``; pads carry token and label
0, loss mask 0 and ``padding_mask`` True. The micro-batch also records, for every document piece,
which rows of the model's flattened ``[b * s, vocab]`` output predict its labels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_hybrid.data.samples import TokenSample
from megatron_hybrid.padding import (
    PaddingConfig,
    equalize_bshd,
    equalize_thd,
    pack_thd,
    packed_seq_params_to,
    pad_bshd,
)
from megatron_hybrid.padding.batch import to_device

__all__ = ["PAD_TOKEN_ID", "MicroBatch", "build_micro_batch", "packed_token_budget"]

PAD_TOKEN_ID = 0
_PADS = {"labels": PAD_TOKEN_ID, "loss_mask": 0.0}


@dataclass
class MicroBatch:
    """One model input and where each document piece's predictions are in its output.

    Attributes:
        inputs: the forward step's batch: ``input_ids``, ``labels``, ``loss_mask``,
            ``position_ids``, ``padding_mask`` (``[b, s]``), ``attention_mask`` (None: causal)
            and ``packed_seq_params`` (None for padded rows).
        spans: ``(sample, first output row, predictions)`` per document piece, in order
            (``sample`` indexes the samples the batch was built from).
        seq_length: the row length the pipeline schedule sees (``T`` packed, ``S`` padded).
        rows: ``b`` (1 when packed).
        num_tokens: the real (unpadded) input tokens.
        results: filled by whoever consumes the output (log-probs: the ``[parts,
            predictions]`` values of the spans' rows, in span order).
    """

    inputs: dict
    spans: list[tuple[int, int, int]]
    seq_length: int
    rows: int
    num_tokens: int
    results: Any = None

    @property
    def labels(self) -> torch.Tensor:
        """``[b * s]``: the label of every output row (0 where a row predicts nothing)."""
        return self.inputs["labels"].reshape(-1)

    @property
    def span_rows(self) -> torch.Tensor:
        """Output rows of every span, in span order (CPU int64)."""
        if not self.spans:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(first, first + n) for _, first, n in self.spans])

    @property
    def packed(self) -> bool:
        return self.inputs["packed_seq_params"] is not None

    def to(self, device) -> MicroBatch:
        """The same micro-batch with its tensors on ``device`` (from the host without waiting:
        :func:`~megatron_hybrid.padding.batch.to_device`)."""
        moved = {k: to_device(v, device) if torch.is_tensor(v) else v
                 for k, v in self.inputs.items()}  # fmt: skip
        if moved["packed_seq_params"] is not None:
            moved["packed_seq_params"] = packed_seq_params_to(moved["packed_seq_params"], device)
        return MicroBatch(moved, self.spans, self.seq_length, self.rows, self.num_tokens)

    @property
    def sequence_lengths(self) -> list[int]:
        """The lengths attention runs over (host integers): each document piece of a packed
        row, each padded row's real tokens (its pieces attend across each other there). The
        step's model FLOPs come from these (``training/throughput.py``)."""
        if self.packed:
            return [length for _, _, length in self.spans]
        per_row: dict[int, int] = {}
        for row, _, length in self.spans:
            per_row[row] = per_row.get(row, 0) + length
        return list(per_row.values())

    def step_inputs(self) -> dict:
        """What ``lm_forward_step`` and ``train_step`` read: the inputs, ``num_tokens`` and
        ``sequence_lengths``."""
        return {
            **self.inputs,
            "num_tokens": self.num_tokens,
            "sequence_lengths": self.sequence_lengths,
        }


def _loss_mask(sample: TokenSample) -> torch.Tensor:
    if sample.loss_mask is None:
        return torch.ones(sample.length, dtype=torch.float32)
    return sample.loss_mask.to(torch.float32)


def _packed(samples, padding, force_total, equalize_group) -> MicroBatch:
    pieces, spans_of = [], []
    for index, sample in enumerate(samples):
        tokens, mask, start = sample.tokens, _loss_mask(sample), 0
        for length in sample.pieces:
            end = start + length
            pieces.append(
                dict(
                    input_ids=tokens[start:end],
                    labels=tokens[start + 1 : end + 1],
                    loss_mask=mask[start:end],
                )
            )
            spans_of.append((index, length))
            start = end
    plan = padding.thd([len(p["input_ids"]) for p in pieces], force_total=force_total)
    if equalize_group is not None and padding.needs_group_equalize:
        plan = equalize_thd(plan, equalize_group)
    packed = pack_thd(pieces, plan, pad_token_id=PAD_TOKEN_ID, pad_values=_PADS)
    inputs = dict(packed.tensors)
    inputs.update(attention_mask=None, packed_seq_params=packed.packed_seq_params)
    spans = [
        (index, first, length)
        for (index, length), first in zip(spans_of, plan.cu_seqlens_padded, strict=False)
    ]
    real = sum(s.length for s in samples)
    return MicroBatch(inputs, spans, plan.total_tokens, 1, real)


def _padded(samples, padding, force_len, rows, equalize_group, min_length) -> MicroBatch:
    count = rows or len(samples)
    if count < len(samples):
        raise ValueError(f"rows={rows} cannot hold {len(samples)} samples")
    lengths = [s.length for s in samples] + [0] * (count - len(samples))
    # A shape bucket is a floor, not a fixed length: HybridEP's group may lengthen it to the
    # longest row of another rank (whose bucket is then the larger one).
    longest = max(*lengths, min_length or 0)
    plan = padding.bshd(cur_len=longest, batch_size=count, force_len=force_len)
    if equalize_group is not None and padding.needs_group_equalize:
        plan = equalize_bshd(plan, equalize_group)
    tokens = torch.full((count, longest), PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.full((count, longest), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros(count, longest)
    for row, sample in enumerate(samples):
        n = sample.length
        tokens[row, :n] = sample.tokens[:-1]
        labels[row, :n] = sample.tokens[1:]
        mask[row, :n] = _loss_mask(sample)
    positions = torch.arange(longest).expand(count, -1).contiguous()
    batch = dict(input_ids=tokens, labels=labels, loss_mask=mask, position_ids=positions)
    inputs = pad_bshd(
        batch, plan, pad_token_id=PAD_TOKEN_ID, pad_values=_PADS, lengths=lengths
    ).tensors
    inputs.update(attention_mask=None, packed_seq_params=None)
    width = plan.padded_len
    spans = []
    for row, sample in enumerate(samples):
        first = row * width
        for length in sample.pieces:
            spans.append((row, first, length))
            first += length
    return MicroBatch(inputs, spans, width, count, sum(lengths))


def build_micro_batch(
    samples: Sequence[TokenSample],
    padding: PaddingConfig,
    *,
    packed: bool,
    fixed_length: int | None = None,
    rows: int | None = None,
    equalize_group=None,
    min_length: int | None = None,
) -> MicroBatch:
    """The micro-batch of ``samples`` (CPU tensors; :meth:`MicroBatch.to` moves it).

    Args:
        samples: the samples, in order (at least one).
        padding: the model's padding settings.
        packed: one THD row, or padded rows.
        fixed_length: a fixed ``T`` (packed: the token budget) or ``S`` (padded), or None.
        rows: a fixed row count (padded; empty rows are all padding), or None.
        equalize_group: the TP x EP group whose HybridEP counts must match (one all-reduce).
        min_length: padded rows at least this long (a shape bucket), or None; unlike
            ``fixed_length`` the group's equalisation may lengthen them further.

    Raises:
        ValueError: the samples do not fit ``fixed_length`` or ``rows``.
    """
    if not samples:
        raise ValueError("build_micro_batch: no samples; a micro-batch needs at least one")
    if min_length is not None and (packed or fixed_length is not None):
        raise ValueError("build_micro_batch: min_length is for padded rows without fixed_length")
    if packed:
        return _packed(list(samples), padding, fixed_length, equalize_group)
    return _padded(list(samples), padding, fixed_length, rows, equalize_group, min_length)


def packed_token_budget(
    padding: PaddingConfig, *, micro_batch_size: int, seq_length: int, max_documents: int
) -> int:
    """The fixed ``T`` of packed micro-batches of ``micro_batch_size`` samples, each of at most
    ``seq_length`` tokens in at most ``max_documents`` pieces: every piece may need up to
    ``s - 1`` alignment tokens (``s``: the per-sequence multiple, ``2 * cp`` under context
    parallelism), and ``T`` is a multiple of the total multiple ``t``. Without context
    parallelism that is ``micro_batch_size * seq_length`` rounded up to ``t``."""
    probe = padding.thd([1])
    s, t = probe.seq_multiple, probe.total_multiple
    per_sample = seq_length + max_documents * (s - 1)
    return math.ceil(micro_batch_size * per_sample / t) * t

"""Packed (THD) boundaries of a fixed size, so that CUDA graphs can replay packed micro-batches.

A packed micro-batch's ``PackedSeqParams`` follows its data: ``cu_seqlens_q`` has one entry per
sequence and one more, ``max_seqlen_q`` is the longest sequence. A captured graph replays the
shapes and host values it was captured with, so a piece that takes packed boundaries can replay
only boundaries of one size whose values it reads on the device. :func:`fixed_capacity_params`
makes them from any packed micro-batch's parameters, from their shapes alone (no host read):

* ``cu_seqlens_q`` / ``_kv``: the real cumulative lengths, the last one repeated up to
  :func:`sequence_capacity` sequences (empty sequences at the end);
* ``cu_seqlens_q_padded`` / ``_kv_padded``: the physical offsets, then the row's length repeated
  (the first appended entry closes a segment of the rows after the last sequence, with no real
  token in it; megatron-core's ``seq_idx`` counts those rows as one more sequence too);
* ``max_seqlen_q`` / ``_kv``: the row's length plus one, a bound that holds for every
  micro-batch of that length (see the rotary table below; kernels that take a bound for the
  longest sequence are given the row's length).

The capacity is a power of two (at least :data:`MIN_CAPACITY`), so micro-batches with 1 to 7
sequences share a graph, those with 8 to 15 the next, and so on: a piece captures one graph per
capacity in use, not one per sequence count.

The rotary table is the other input whose shape follows the data: megatron-core sizes it by
``max_seqlen_q`` (``RotaryEmbedding.get_rotary_seq_len``; the model once per forward, MLA in
each layer). Sized by the row instead, every row of one length has one table: by its length plus
one, longer than any of its sequences and not the row's length itself, which megatron's THD
RoPE reads as positions counted over the whole row. :func:`rope_table_params` gives the model's
preprocessing parameters sized so.

Only pieces that read the boundaries on the device take these parameters (``schedule.graphs``:
the fast attention and MLA, through the varlen FlashAttention and the THD RoPE; GatedDeltaNet on
fla's kernels; the torch Mamba mixer, through :func:`fixed_seq_idx`); everything else keeps the
micro-batch's own ``PackedSeqParams``.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_hybrid.padding.batch import derived

__all__ = [
    "MIN_CAPACITY",
    "FixedPackedSeqParams",
    "fixed_capacity_params",
    "fixed_seq_idx",
    "rope_restart",
    "rope_table_params",
    "row_segments",
    "sequence_capacity",
]

#: The smallest capacity: rows of a few documents (the usual case) share one graph.
MIN_CAPACITY = 8


def sequence_capacity(sequences: int) -> int:
    """The segments a fixed-size ``cu_seqlens`` holds for a row of ``sequences`` sequences: room
    for one more (the rows after the last sequence), rounded up to a power of two, at least
    :data:`MIN_CAPACITY`."""
    if sequences < 0:
        raise ValueError(f"sequence_capacity: sequences must be >= 0, got {sequences}")
    return max(MIN_CAPACITY, 1 << sequences.bit_length())


@dataclass
class FixedPackedSeqParams(PackedSeqParams):
    """megatron's ``PackedSeqParams`` with boundaries of a fixed size (see the module doc).

    ``cu_seqlens_kv`` is ``cu_seqlens_q`` and ``cu_seqlens_kv_padded`` is
    ``cu_seqlens_q_padded`` (self-attention), ``seq_idx`` is None, ``pad_between_seqs`` is True.
    Readers take every boundary from the device tensors: a host value would be the capture's.
    """

    def __post_init__(self):
        # megatron-core derives seq_idx here with a data-dependent repeat_interleave (a host
        # wait); the pieces that take fixed boundaries read none.
        pass

    @property
    def capacity(self) -> int:
        """The sequences the boundaries hold (empty ones included)."""
        return self.cu_seqlens_q.numel() - 1

    def with_boundaries(self, real: torch.Tensor, padded: torch.Tensor) -> FixedPackedSeqParams:
        """These parameters with the real and padded boundaries ``real`` and ``padded``."""
        params = copy.copy(self)
        params.cu_seqlens_q = params.cu_seqlens_kv = real
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = padded
        return params


def fixed_capacity_params(params: PackedSeqParams) -> FixedPackedSeqParams | str:
    """``params`` as :class:`FixedPackedSeqParams`, or why they cannot be.

    Computed once per micro-batch (kept for as long as its ``cu_seqlens_q`` lives and neither
    boundary tensor changes: the layers of a forward share them) in a few device kernels;
    nothing is read on the host.

    Args:
        params: a packed micro-batch's parameters with ``total_tokens`` set (the row's length,
            as :func:`~megatron_hybrid.padding.batch.packed_seq_params_from` sets it).

    Returns:
        The fixed-size parameters, or a sentence saying why there are none: not THD, context
        parallelism (each rank holds its own part of every sequence), cross-attention
        boundaries, no ``total_tokens``, or boundary tensors of different sizes.
    """
    if params.qkv_format != "thd":
        return f"packed_seq_params in the {params.qkv_format!r} format, not 'thd'"
    if (params.local_cp_size or 1) > 1 or params.cp_group is not None:
        return "packed sequences split over context-parallel ranks"
    if params.cu_seqlens_q is None or params.total_tokens is None:
        return "packed_seq_params without cu_seqlens_q or total_tokens (the row's length)"
    kv, kv_padded = params.cu_seqlens_kv, params.cu_seqlens_kv_padded
    # Identity, not values: comparing values would read them on the host.
    if not (kv is None or kv is params.cu_seqlens_q) or not (
        kv_padded is None or kv_padded is params.cu_seqlens_q_padded
    ):
        return "key/value boundaries that are not the query's (cross-attention)"
    real, given = params.cu_seqlens_q, params.cu_seqlens_q_padded
    padded = real if given is None else given
    if padded.numel() != real.numel():
        return (
            f"packed_seq_params: cu_seqlens_q_padded has {padded.numel()} entries and "
            f"cu_seqlens_q {real.numel()}; both need one per sequence and one more"
        )
    # Versions: a loader may refill its boundary buffers in place.
    key = ("fixed_capacity", params.total_tokens, real._version, id(padded), padded._version)
    held, fixed = derived(real, key, lambda: (weakref.ref(padded), _fixed(real, padded, params)))
    if held() is not padded:  # another tensor at a freed one's address
        return _fixed(real, padded, params)
    return fixed


def _fixed(real: torch.Tensor, padded: torch.Tensor, params) -> FixedPackedSeqParams:
    total = params.total_tokens
    extra = sequence_capacity(real.numel() - 1) + 1 - real.numel()
    fixed_real = torch.cat([real, real[-1:].expand(extra)])
    fixed_padded = torch.cat([padded, padded.new_full((extra,), total)])
    return FixedPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=fixed_real,
        cu_seqlens_kv=fixed_real,
        cu_seqlens_q_padded=fixed_padded,
        cu_seqlens_kv_padded=fixed_padded,
        max_seqlen_q=_table_length(total),
        max_seqlen_kv=_table_length(total),
        total_tokens=total,
        pad_between_seqs=True,
    )


def row_segments(starts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The segment holding each of ``rows``, on the device (no host read).

    Args:
        starts: non-decreasing segment starts (boundaries; an empty segment repeats the next
            one's start and holds no row).
        rows: row indices, in ``starts``' dtype.

    Returns:
        Per row, the last ``i`` with ``starts[i] <= row`` (``-1`` before ``starts[0]``).
    """
    return torch.searchsorted(starts, rows, right=True) - 1


def fixed_seq_idx(params: FixedPackedSeqParams) -> torch.Tensor:
    """megatron-core's ``seq_idx`` of the micro-batch that ``params`` were made from, computed on
    the device from the fixed boundaries.

    The empty sequences the capacity adds own no row, as empty sequences do in megatron's; made
    anew on every call (no host read), so a CUDA graph records it.

    Args:
        params: fixed-size parameters (:func:`fixed_capacity_params`).

    Returns:
        ``[1, total_tokens]`` int32: each row's segment of ``cu_seqlens_q_padded``, the rows after
        the last sequence one more (0.19.2's ``PackedSeqParams.__post_init__``).
    """
    padded = params.cu_seqlens_q_padded
    rows = torch.arange(params.total_tokens, device=padded.device, dtype=padded.dtype)
    return row_segments(padded, rows).to(torch.int32).unsqueeze(0)


def rope_restart(params: PackedSeqParams | None) -> bool | None:
    """Whether THD RoPE positions restart in every sequence for ``params``: True for fixed-size
    boundaries, whose rotary table is sized by the row (see the module doc), so the table's
    length no longer tells megatron's whole-row positions apart; None (megatron's own rule, by
    the table's length) for any other parameters."""
    return True if isinstance(params, FixedPackedSeqParams) else None


def rope_table_params(params: PackedSeqParams | None) -> PackedSeqParams | None:
    """``params`` for sizing the rotary table of a forward whose pieces replay CUDA graphs.

    Where ``params`` have a fixed-size form (:func:`fixed_capacity_params`), a copy with
    ``max_seqlen_q`` and ``max_seqlen_kv`` the row's length plus one (see the module doc); else
    ``params`` as they are. Only the table's length changes: each sequence's positions, and so
    the rotation, are the same.
    """
    if params is None or isinstance(fixed_capacity_params(params), str):
        return params
    sized = copy.copy(params)  # not dataclasses.replace: __post_init__ would redo seq_idx
    sized.max_seqlen_q = sized.max_seqlen_kv = _table_length(params.total_tokens)
    return sized


def _table_length(total: int) -> int:
    """The rotary table's length for rows of ``total`` tokens (see the module doc)."""
    return total + 1

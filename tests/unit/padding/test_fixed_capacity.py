"""Fixed-size packed boundaries (``padding/fixed.py``): what CUDA graphs replay packed rows with.

Checked against the micro-batch's own boundaries from the packer: the same sequences, then
empty ones to a power-of-two count, ``max_seqlen`` the row's length plus one, megatron-core's
``seq_idx`` of the rows unchanged, computed once per micro-batch and again when a boundary
tensor changes in place; parameters that have no fixed-size form say why. Negative control:
boundaries whose tail is not closed at the row's length fail the same checks.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_hybrid.padding import pack_thd, thd_pack
from megatron_hybrid.padding.batch import seq_idx_of
from megatron_hybrid.padding.fixed import (
    MIN_CAPACITY,
    FixedPackedSeqParams,
    fixed_capacity_params,
    fixed_seq_idx,
    sequence_capacity,
)


@pytest.mark.parametrize(
    "sequences, capacity",
    [(0, 8), (1, 8), (7, 8), (8, 16), (15, 16), (16, 32), (100, 128)],
    ids=lambda v: str(v),
)
def test_capacity_leaves_room_for_the_rows_after_the_last_sequence(sequences, capacity):
    assert sequence_capacity(sequences) == capacity
    assert capacity >= max(MIN_CAPACITY, sequences + 1)


def test_capacity_refuses_a_negative_count():
    with pytest.raises(ValueError, match="sequences must be >= 0, got -1"):
        sequence_capacity(-1)


def _packed(lengths, *, gaps: bool, total: int | None = None):
    """The packer's parameters for ``lengths`` (pads between sequences if ``gaps``) in a row of
    ``total`` rows (the plan's own total where None)."""
    plan = thd_pack(lengths, tp=4 if gaps else 1, cp=1, sp=gaps, hybridep=False, mode="upstream")
    sequences = [{"input_ids": torch.arange(1, n + 1)} for n in lengths]
    params = pack_thd(sequences, plan).packed_seq_params
    if total is not None:
        params.total_tokens = total
    return params


def _check(fixed, params, sequences: int) -> None:
    """``fixed`` holds ``params``' sequences of a row of 40, then empty ones."""
    assert isinstance(fixed, FixedPackedSeqParams)
    capacity = sequence_capacity(sequences)
    assert fixed.capacity == capacity
    real, padded = params.cu_seqlens_q.tolist(), params.cu_seqlens_q_padded.tolist()
    extra = capacity + 1 - len(real)
    assert fixed.cu_seqlens_q.tolist() == real + [real[-1]] * extra
    assert fixed.cu_seqlens_q_padded.tolist() == padded + [40] * extra
    assert fixed.cu_seqlens_kv is fixed.cu_seqlens_q
    assert fixed.cu_seqlens_kv_padded is fixed.cu_seqlens_q_padded
    assert fixed.cu_seqlens_q.dtype == params.cu_seqlens_q.dtype
    # A bound for every sequence that megatron's RoPE does not read as whole-row positions.
    assert (fixed.max_seqlen_q, fixed.max_seqlen_kv, fixed.total_tokens) == (41, 41, 40)
    assert fixed.seq_idx is None and fixed.pad_between_seqs and fixed.qkv_format == "thd"
    # The same rows: megatron-core's seq_idx of the fixed boundaries is the micro-batch's.
    assert torch.equal(seq_idx_of(fixed.cu_seqlens_q_padded.tolist(), 40), seq_idx_of(padded, 40))
    # ... and the one the torch Mamba mixer makes from them on the device.
    assert torch.equal(fixed_seq_idx(fixed), seq_idx_of(padded, 40))


@pytest.mark.parametrize("gaps", [False, True], ids=["back-to-back", "padded-apart"])
@pytest.mark.parametrize("lengths", [[5, 1, 7], [3] * 9], ids=["three", "nine"])
def test_fixed_boundaries_are_the_sequences_then_empty_ones(lengths, gaps):
    params = _packed(lengths, gaps=gaps, total=40)
    _check(fixed_capacity_params(params), params, len(lengths))


def test_negative_control_a_tail_not_closed_at_the_row_is_caught():
    params = _packed([5, 1, 7], gaps=True, total=40)
    fixed = fixed_capacity_params(params)
    padded = fixed.cu_seqlens_q_padded
    last = params.cu_seqlens_q_padded[-1]
    short = torch.where(padded == 40, last, padded)  # empty segments at the last sequence's end
    with pytest.raises(AssertionError):
        _check(fixed.with_boundaries(fixed.cu_seqlens_q, short), params, 3)


def test_fixed_boundaries_are_made_once_per_micro_batch():
    params = _packed([5, 1, 7], gaps=True, total=40)
    first = fixed_capacity_params(params)
    assert fixed_capacity_params(params) is first  # every layer of a forward asks again
    params.total_tokens = 48
    assert fixed_capacity_params(params).total_tokens == 48
    assert fixed_capacity_params(_packed([5, 1, 7], gaps=True, total=40)) is not first
    params.total_tokens = 40
    assert fixed_capacity_params(params) is first
    params.cu_seqlens_q_padded[1] += 0  # refilled in place, as a loader's buffer may be
    again = fixed_capacity_params(params)
    assert again is not first and torch.equal(again.cu_seqlens_q_padded, first.cu_seqlens_q_padded)


def test_replaced_boundaries_keep_the_rest():
    fixed = fixed_capacity_params(_packed([5, 1, 7], gaps=False, total=40))
    real, padded = torch.zeros(9, dtype=torch.int32), torch.ones(9, dtype=torch.int32)
    moved = fixed.with_boundaries(real, padded)
    assert moved.cu_seqlens_q is real and moved.cu_seqlens_kv is real
    assert moved.cu_seqlens_q_padded is padded and moved.cu_seqlens_kv_padded is padded
    assert moved.total_tokens == 40 and fixed.cu_seqlens_q is not real


def _with(**changes) -> PackedSeqParams:
    params = _packed([5, 1, 7], gaps=False, total=40)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    "changes, reason",
    [
        pytest.param({"qkv_format": "sbhd"}, "in the 'sbhd' format, not 'thd'", id="not-thd"),
        pytest.param({"local_cp_size": 2}, "context-parallel ranks", id="context-parallel"),
        pytest.param({"total_tokens": None}, "without cu_seqlens_q or total_tokens", id="no-total"),
        pytest.param({"cu_seqlens_kv": torch.tensor([0, 5, 6, 13], dtype=torch.int32)},
                     "cross-attention", id="other-kv"),  # equal values, another tensor
    ],
)  # fmt: skip
def test_parameters_without_a_fixed_form_say_why(changes, reason):
    found = fixed_capacity_params(_with(**changes))
    assert isinstance(found, str) and reason in found


def test_boundaries_of_different_sizes_say_why():
    params = _with(cu_seqlens_q_padded=torch.tensor([0, 8, 16], dtype=torch.int32))
    params.cu_seqlens_kv_padded = params.cu_seqlens_q_padded
    found = fixed_capacity_params(params)
    assert "cu_seqlens_q_padded has 3 entries and cu_seqlens_q 4" in found


def test_rope_table_params_size_the_table_by_the_row():
    from megatron_hybrid.padding.fixed import rope_table_params

    params = _packed([5, 1, 7], gaps=True, total=40)
    sized = rope_table_params(params)
    assert (sized.max_seqlen_q, sized.max_seqlen_kv) == (41, 41)
    assert sized.cu_seqlens_q is params.cu_seqlens_q and sized.seq_idx is params.seq_idx
    assert params.max_seqlen_q == 8  # the micro-batch's own parameters are untouched
    cp = _with(local_cp_size=2)
    assert rope_table_params(cp) is cp and rope_table_params(None) is None


@pytest.mark.parametrize(
    "padded, total",
    [([0, 4, 4, 10], 16), ([0, 5, 7, 11], 16), ([0, 16], 16), ([0, 3, 3, 3, 9], 9)],
    ids=["empty-sequence", "megatron-s-example", "one-sequence", "empty-at-the-end"],
)
def test_fixed_seq_idx_is_megatron_s(padded, total):
    """The device-made ``seq_idx`` equals megatron-core's own ``__post_init__`` (0.19.2) for
    the micro-batch, empty sequences and the rows after the last one included; the control
    (``searchsorted`` to the left) gives the rows at a boundary the earlier sequence."""
    bounds = torch.tensor(padded, dtype=torch.int32)
    own = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                          cu_seqlens_q_padded=bounds, cu_seqlens_kv_padded=bounds,
                          max_seqlen_q=total, max_seqlen_kv=total, total_tokens=total)  # fmt: skip
    fixed = fixed_capacity_params(own)
    assert torch.equal(fixed_seq_idx(fixed), own.seq_idx)
    rows = torch.arange(total, dtype=torch.int32)
    left = torch.searchsorted(fixed.cu_seqlens_q_padded, rows) - 1
    assert not torch.equal(left.to(torch.int32).unsqueeze(0), own.seq_idx)

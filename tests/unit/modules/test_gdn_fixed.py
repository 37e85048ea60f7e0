"""GatedDeltaNet on fixed-size packed boundaries (what a CUDA-graphed piece gets): fla's chunk
table built on the device in a fixed size, and the layer's forward with no host read.

The table must hold fla's own chunk rows first (``fla_chunk_indices``, itself checked against
fla's ``prepare_chunk_indices``) and point every spare row at an empty segment, where fla's
kernels load and store nothing; the control is boundaries whose last segment holds rows. The
layer (the CPU runtime's stand-ins for fla's kernels) must give what the micro-batch's own
parameters give, bit for bit, without reading the boundaries on the host.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from support.gdn_layer import build_gated_delta_net, layer_step
from support.packing import pack_apart

from megatron_hybrid.modules import gated_delta_net
from megatron_hybrid.modules.gated_delta_net import (
    fixed_chunk_indices,
    fixed_fla_boundaries,
    fla_chunk_indices,
)
from megatron_hybrid.padding.fixed import fixed_capacity_params

CHUNK = gated_delta_net.FLA_CHUNK_SIZE


def _params(real: list[int], padded: list[int], total: int) -> PackedSeqParams:
    real_t, padded_t = (torch.tensor(x, dtype=torch.int32) for x in (real, padded))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real_t, cu_seqlens_kv=real_t,
                             cu_seqlens_q_padded=padded_t, cu_seqlens_kv_padded=padded_t,
                             max_seqlen_q=total, max_seqlen_kv=total)  # fmt: skip
    params.total_tokens = total
    return params


def _spares_are_inert(table: torch.Tensor, boundaries: torch.Tensor) -> bool:
    """Every row past fla's own names chunk 0 of an empty segment."""
    own = fla_chunk_indices(boundaries.clone())  # from the host values: fla's rows
    spares = table[len(own) :]
    bounds = boundaries.tolist()
    return torch.equal(table[: len(own)], own) and all(
        chunk == 0 and bounds[segment] == bounds[segment + 1] for segment, chunk in spares.tolist()
    )


CASES = [
    pytest.param([0, 10, 30, 48], [0, 10, 30, 64], 64, id="three-short"),
    pytest.param([0, 65, 130, 195, 250], [0, 65, 130, 195, 256], 256, id="partial-chunks"),
    pytest.param([0, 64, 128, 192, 256], [0, 64, 128, 192, 256], 256, id="whole-chunks"),
    pytest.param([0, 1] + [1] * 6 + [300], [0, 4] + [4] * 6 + [320], 320, id="empty-sequences"),
    pytest.param(list(range(0, 71, 10)), list(range(0, 71, 10)), 512, id="rows-after-the-last"),
]


@pytest.mark.parametrize("real, padded, total", CASES)
def test_the_fixed_table_holds_fla_s_chunks_then_inert_spares(real, padded, total):
    """The table of :func:`fixed_fla_boundaries` has ``total // 64 + segments`` rows: fla's
    (and fla 0.6.0's own ``prepare_chunk_indices``, where fla imports) first, then spare rows on
    the appended empty segment; :func:`fla_chunk_indices` finds it for the boundaries.
    ``rows-after-the-last``: seven sequences fill capacity 8 but for the segment of the rows
    after them, which is where spare rows would land without the appended segment (the
    control)."""
    fixed = fixed_capacity_params(_params(real, padded, total))
    boundaries = fixed_fla_boundaries(fixed)
    segments = boundaries.numel() - 1
    assert segments == fixed.capacity + 1 and boundaries[-1].item() == total
    table = fla_chunk_indices(boundaries)  # the one made with the boundaries, not a host copy
    assert table.shape == (total // CHUNK + segments, 2) and table.dtype == boundaries.dtype
    assert _spares_are_inert(table, boundaries)
    chunks = sum(-(-(b - a) // CHUNK) for a, b in pairwise(boundaries.tolist()))
    assert len(table) - chunks >= 1  # room for every row of chunks, and a spare
    try:
        from fla.ops.utils.index import prepare_chunk_indices
    except ImportError:
        pass
    else:
        assert torch.equal(table[:chunks], prepare_chunk_indices(boundaries.clone(), CHUNK))
    if padded[-1] < total:  # control: the capacity's own last segment holds the trailing rows
        unpadded = fixed_chunk_indices(fixed.cu_seqlens_q_padded, total)
        assert not _spares_are_inert(unpadded, fixed.cu_seqlens_q_padded)


def test_the_table_bound_holds_for_the_most_chunks_a_row_can_have():
    """Every segment one token past a chunk boundary (two chunks, one of them one token long):
    the most chunks ``rows`` tokens in that many segments can have still fit."""
    lengths = [CHUNK + 1] * 7
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    total = bounds[-1]
    boundaries = torch.tensor(bounds + [total], dtype=torch.int32)
    table = fixed_chunk_indices(boundaries, total)
    assert len(table) == total // CHUNK + 8 == 14 + 1
    assert _spares_are_inert(table, boundaries)


def _layer(pg):
    torch.manual_seed(3)
    return build_gated_delta_net(pg, deterministic_mode=False)


def test_the_layer_on_fixed_boundaries_equals_its_own_parameters_with_no_host_read(pg, monkeypatch):
    """The output and every gradient on fixed-size boundaries equal the micro-batch's own
    parameters' bit for bit, and the layer's own code reads no boundary on the host
    (``host_values`` raises; the CPU stand-ins of fla's kernels read them, as emulation); the
    control: the micro-batch's own parameters do read them."""
    layer = _layer(pg)
    batch = pack_apart([10, 20, 18], total=64, seed=1)
    own = batch.packed_seq_params
    hidden = torch.randn(64, 1, layer.config.hidden_size,
                         generator=torch.Generator().manual_seed(2))  # fmt: skip
    want = layer_step(layer, hidden, own)

    def no_host_read(tensor):
        raise AssertionError("the boundaries were read on the host")

    monkeypatch.setattr(gated_delta_net, "host_values", no_host_read)
    fixed = fixed_capacity_params(own)
    got = layer_step(layer, hidden, fixed)
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert torch.equal(value, want[name]), name
    assert layer._fixed_cu_seqlens is None  # nothing kept past the forward
    with pytest.raises(AssertionError, match="read on the host"):
        layer_step(layer, hidden, pack_apart([10, 20, 18], total=64, seed=1).packed_seq_params)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(rows=32), "fixed-size packed boundaries for rows of 64 tokens, given 32 rows"),
        (dict(deterministic_mode=True), "and a rule without fla's"),
    ],
    ids=["another-row", "torch-rule"],
)
def test_fixed_boundaries_are_refused_where_they_do_not_apply(pg, change, match):
    """Boundaries built for another row's length, or a layer on megatron's torch rule
    (``deterministic_mode``), are refused before any work, saying what to pass instead."""
    torch.manual_seed(3)
    layer = build_gated_delta_net(pg, deterministic_mode=change.get("deterministic_mode", False))
    fixed = fixed_capacity_params(pack_apart([10, 20, 18], total=64).packed_seq_params)
    hidden = torch.randn(change.get("rows", 64), 1, layer.config.hidden_size)
    with pytest.raises(ValueError, match=match):
        layer(hidden, attention_mask=None, packed_seq_params=fixed)
    assert layer.reads_fixed_packed_on_device == ("deterministic_mode" not in change)

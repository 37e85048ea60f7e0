"""GatedDeltaNet on fla's kernels with fixed-size packed boundaries (what a CUDA-graphed piece
gets) against the micro-batch's own boundaries, on a GPU.

The fixed chunk table (``modules/gated_delta_net.py``, :func:`fixed_chunk_indices`) has more rows
than the row has chunks; the spare ones name an empty segment, where fla 0.6.0's kernels load and
store nothing. Here the allocator is filled with NaN first, so a spare row that read or wrote
memory it does not own would show; the forward runs under torch's sync debug mode (any host
synchronisation raises). The control points the spare rows at the segment of the rows after the
last sequence instead (no empty segment appended): the conv's weight gradient, a sum of one
partial per table row, then counts that segment's first chunk more than once, and the rule's
spare programs read state rows that nothing wrote (NaN after the poison) and store them.

    torchrun --nproc_per_node 1 -m pytest -q -s tests/functional/test_gdn_fixed_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from conftest import report, require_fla_training
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_hybrid.testing.overlap import rel_error

#: Seven sequences (capacity 8), each padded to a multiple of 4, then rows after the last.
LENGTHS = (57, 18, 70, 5, 33, 41, 9)
TOTAL = 320


def _params(with_tail_segment: bool, device) -> PackedSeqParams:
    """The row's parameters: the trailing rows as an eighth (empty) sequence's padding, as a
    micro-batch of its own gives them to megatron (which needs the last boundary at the row's
    end), or left after the last boundary, as fixed-size boundaries then make them a segment."""
    real, padded = [0], [0]
    for n in LENGTHS:
        real.append(real[-1] + n)
        padded.append(padded[-1] + -(-n // 4) * 4)
    if with_tail_segment:
        real.append(real[-1])
        padded.append(TOTAL)
    real_t, padded_t = (torch.tensor(x, dtype=torch.int32, device=device) for x in (real, padded))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real_t, cu_seqlens_kv=real_t,
                             cu_seqlens_q_padded=padded_t, cu_seqlens_kv_padded=padded_t,
                             max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))  # fmt: skip
    params.total_tokens = TOTAL
    return params


def _poison_the_allocator(device) -> None:
    """Fill free memory of both of the caching allocator's pools with NaN, so buffers made next
    likely start as NaN: one large block, and many blocks of up to 1 MiB (the small pool, which
    serves the layer's buffers at this size)."""
    free, _ = torch.cuda.mem_get_info(device)
    large = torch.full((min(free // 8, 1 << 30) // 4,), float("nan"), device=device)
    small = [torch.full((n,), float("nan"), device=device)
             for n in (1 << 18, 1 << 16, 1 << 14) for _ in range(64)]  # fmt: skip
    del large, small


@pytest.mark.time_limit(300)  # fla compiles its varlen kernels on first use
def test_fixed_boundaries_on_fla_match_the_micro_batch_s_own(world, monkeypatch):
    from support.gdn_layer import build_gated_delta_net, layer_step

    from megatron_hybrid.modules import gated_delta_net
    from megatron_hybrid.padding.fixed import fixed_capacity_params
    from megatron_hybrid.process_groups import initialize_model_parallel, reset_megatron_state

    _, _, device = world
    require_fla_training(device)
    pg = initialize_model_parallel(seed=1)
    try:
        torch.manual_seed(3)
        layer = build_gated_delta_net(
            pg, deterministic_mode=False, hidden_size=128, params_dtype=torch.bfloat16, bf16=True
        ).to(device)
        hidden = torch.randn(TOTAL, 1, layer.config.hidden_size,
                             generator=torch.Generator().manual_seed(4))  # fmt: skip
        hidden = hidden.to(device, torch.bfloat16)
        own = _params(True, device)
        want = layer_step(layer, hidden, own)
        again = layer_step(layer, hidden, own)
        fixed = fixed_capacity_params(_params(False, device))
        _poison_the_allocator(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = layer_step(layer, hidden, fixed)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        original = gated_delta_net.fixed_fla_boundaries

        def no_empty_segment(params, chunk_size=gated_delta_net.FLA_CHUNK_SIZE):
            boundaries = params.cu_seqlens_q_padded.clone()
            table = gated_delta_net.fixed_chunk_indices(boundaries, params.total_tokens)
            gated_delta_net.derived(boundaries, ("fla_chunk_indices", chunk_size), lambda: table)
            return boundaries

        monkeypatch.setattr(gated_delta_net, "fixed_fla_boundaries", no_empty_segment)
        control = layer_step(layer, hidden, fixed)
        monkeypatch.setattr(gated_delta_net, "fixed_fla_boundaries", original)
    finally:
        reset_megatron_state()

    noise = {n: rel_error(again[n], v) for n, v in want.items()}
    diff = {n: rel_error(got[n], v) for n, v in want.items()}
    wrong = {n: rel_error(control[n], v) for n, v in want.items()}
    report("GatedDeltaNet on fla: fixed-size boundaries vs the micro-batch's own (bf16)", [
        ("tensor", "fixed vs own", "own vs own", "control: spares on a full segment"),
        *((n, f"{diff[n]:.2e}", f"{noise[n]:.2e}", f"{wrong[n]:.2e}") for n in want),
    ])  # fmt: skip
    assert torch.equal(got["out"], want["out"]), "the forward differs"
    assert all(torch.isfinite(v).all() for v in got.values()), "a spare row wrote NaN"
    beyond = {n: (d, noise[n]) for n, d in diff.items() if d > 2 * noise[n]}
    assert not beyond, f"gradients differ beyond the layer's own run-to-run difference: {beyond}"
    # Spare rows on a full segment count its first chunk again in the conv's weight gradient,
    # and read state rows fla never wrote for them (NaN after the poison).
    assert not wrong["conv1d.weight"] <= 1e-2, "spare rows on a full segment went unnoticed"

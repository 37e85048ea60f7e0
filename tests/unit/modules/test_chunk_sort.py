"""The received chunks sorted by local expert with one gather (EP > 1), against megatron-core's
``sort_chunks_by_idxs`` (a split and a concatenation).

``chunk_order`` must give the rows in megatron's order, bit for bit, with empty chunks among
them, and its transposed call must undo it; ``reorder_rows``'s gradient must be the split and
concatenation's. At EP 2 on two gloo ranks, ``SyncFreeAllToAllDispatcher`` must hand the experts
the same rows, counts and probabilities as megatron's all-to-all dispatcher and give the same
output and gradients, without calling ``sort_chunks_by_idxs``. Negative controls: the counts read
transposed give another order; megatron's dispatcher does call the split sort.
"""

from __future__ import annotations

import pytest
import torch

HIDDEN, EXPERTS, TOKENS, TOPK = 8, 8, 12, 2


def _megatron_sort(rows, counts, order):
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    out, _ = sort_chunks_by_idxs(rows, counts.ravel(), order)
    return out


def _sort_indices(ranks: int, local: int):
    """megatron's ``sort_input_by_local_experts`` and ``restore_output_by_local_experts``."""
    chunks = torch.arange(ranks * local)
    return chunks.reshape(-1, local).T.ravel(), chunks.reshape(local, -1).T.ravel()


@pytest.mark.parametrize(
    "counts",
    [[[3, 0, 2], [1, 4, 0]], [[0, 0], [0, 5], [2, 0], [1, 1]], [[4]], [[0, 0], [0, 0]]],
    ids=["two-ranks", "four-ranks-empty-chunks", "one-chunk", "no-rows"],
)
def test_chunk_order_is_megatrons_sort(counts):
    from megatron_hybrid.modules.fast.permutation import chunk_order, inverse_order, reorder_rows

    counts = torch.tensor(counts)
    ranks, local = counts.shape
    rows = int(counts.sum())
    values = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(0))
    sort, restore = _sort_indices(ranks, local)

    order, inverse = chunk_order(counts, rows), inverse_order(chunk_order(counts, rows))
    assert torch.equal(values[order], _megatron_sort(values, counts, sort))
    assert torch.equal(chunk_order(counts.T, rows), inverse)  # the transposed call: the same
    # The inverse sorts the experts' output back by source rank, as megatron's restore does.
    assert torch.equal(values[order][inverse], values)
    assert torch.equal(values[inverse], _megatron_sort(values, counts.T, restore))

    # Gradients: the gather's backward is the inverse gather, as the split and cat's.
    grad = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1))
    ours = values.clone().requires_grad_()
    reorder_rows(ours, order, inverse).backward(grad)
    theirs = values.clone().requires_grad_()
    _megatron_sort(theirs, counts, sort).backward(grad)
    assert torch.equal(ours.grad, theirs.grad)


def test_counts_read_the_other_way_give_another_order():
    """Negative control: the chunks' layout matters (rank-major, then local expert)."""
    from megatron_hybrid.modules.fast.permutation import chunk_order

    counts = torch.tensor([[3, 0, 2], [1, 4, 0]])
    values = torch.arange(10.0).unsqueeze(1)
    sort, _ = _sort_indices(2, 3)
    wrong = chunk_order(counts.T.contiguous().view(2, 3), 10)
    assert not torch.equal(values[wrong], _megatron_sort(values, counts, sort))


def _round_trip(dispatcher, hidden, probs, routing_map):
    hidden = hidden.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    tokens, permuted_probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    tokens, permuted_probs = dispatcher.token_dispatch(tokens, permuted_probs)
    tokens, counts, permuted_probs = dispatcher.dispatch_postprocess(tokens, permuted_probs)
    # Stands for the experts: a different function of each row and its probability.
    scaled = tokens * permuted_probs.unsqueeze(-1) * torch.arange(1.0, tokens.shape[0] + 1)[:, None]
    out = dispatcher.combine_postprocess(
        dispatcher.token_combine(dispatcher.combine_preprocess(scaled))
    )
    out.backward(torch.linspace(-1.0, 1.0, out.numel()).view_as(out))
    return {"tokens": tokens.detach(), "counts": torch.as_tensor(counts),
            "probs": permuted_probs.detach(), "out": out.detach(), "hidden_grad": hidden.grad,
            "probs_grad": probs.grad}  # fmt: skip


def _ep2_worker(rank, world_size):
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    pg = initialize_model_parallel(tp=1, pp=1, ep=2, seed=3)
    sorts = []
    original = token_dispatcher.sort_chunks_by_idxs
    token_dispatcher.sort_chunks_by_idxs = lambda *a, **k: sorts.append(1) or original(*a, **k)
    # 4 local experts per rank (chunks to sort), and 1 (nothing to sort: megatron sorts none).
    return {experts: _ep2_case(rank, world_size, pg, experts, sorts) for experts in (EXPERTS, 2)}


def _ep2_case(rank, world_size, pg, experts, sorts):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_hybrid.modules.fast.dispatch import SyncFreeAllToAllDispatcher
    from megatron_hybrid.testing.models import small_config

    config = small_config("E", hidden_size=HIDDEN, num_attention_heads=2, moe_ffn_hidden_size=8,
                          num_moe_experts=experts, moe_router_topk=TOPK,
                          expert_model_parallel_size=2)  # fmt: skip
    local = experts // world_size
    args = (local, list(range(rank * local, (rank + 1) * local)))
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own tokens
    hidden = torch.randn(TOKENS, 1, HIDDEN, generator=gen)
    logits = torch.randn(TOKENS, experts, generator=gen)
    logits[:, 0] += 4.0  # an uneven load: expert 0 takes every token
    top = logits.topk(TOPK, dim=-1).indices
    routing_map = torch.zeros(TOKENS, experts, dtype=torch.bool).scatter(1, top, True)
    probs = logits.softmax(-1) * routing_map

    sorts.clear()
    ref = MoEAlltoAllTokenDispatcher(*args, config=config, pg_collection=pg)
    expected = _round_trip(ref, hidden, probs, routing_map)
    megatron_sorts = len(sorts)
    sorts.clear()
    fast = SyncFreeAllToAllDispatcher(*args, config=config, pg_collection=pg)
    got = _round_trip(fast, hidden, probs, routing_map)
    return {"reason": fast.chunk_sort_reason, "megatron_sorts": megatron_sorts,
            "fast_sorts": len(sorts), "rows": got["tokens"].shape[0],
            "left": (fast._chunk_counts, fast._chunk_orders),
            "equal": {k: torch.equal(got[k], expected[k]) for k in expected}}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
def test_sync_free_dispatcher_sorts_chunks_as_megatron_at_ep2():
    pytest.importorskip("psutil")
    from megatron_hybrid.testing.spawn import run_distributed

    results = run_distributed(_ep2_worker, 2, timeout=300)
    for by_experts in results:
        for experts, result in by_experts.items():
            assert result["reason"] is None
            assert result["equal"] == {k: True for k in result["equal"]}, experts
            assert result["fast_sorts"] == 0
            assert result["left"] == (None, None)  # nothing kept past the combine
        # Control: megatron sorts after the dispatch and before the combine, with several local
        # experts only.
        assert by_experts[EXPERTS]["megatron_sorts"] == 2
        assert by_experts[2]["megatron_sorts"] == 0
    # Uneven: the rank with expert 0 receives more rows than it sent.
    assert results[0][EXPERTS]["rows"] > TOKENS * TOPK > results[1][EXPERTS]["rows"]


def test_chunk_sort_reasons():
    import types

    from megatron_hybrid.modules.fast.selection import chunk_sort_reason

    def dispatcher(fusion=False, capacity=None, tp_size=1):
        config = types.SimpleNamespace(moe_permute_fusion=fusion,
                                       moe_expert_capacity_factor=capacity)  # fmt: skip
        return types.SimpleNamespace(config=config, drop_and_pad=False, tp_size=tp_size)

    assert chunk_sort_reason(dispatcher()) is None
    assert "fused chunk sort" in chunk_sort_reason(dispatcher(fusion=True))
    assert "token dropping" in chunk_sort_reason(dispatcher(capacity=1.0))
    assert "expert tensor parallelism 2" in chunk_sort_reason(dispatcher(tp_size=2))

"""Equal per-rank counts across the TP×EP group: G1 (spec §7) and the one-collective step (§6).

The pure tests simulate a group: every rank plans its own micro-batch, the group maximum is
taken with ``group_equalize`` and each plan is extended to it. The distributed test runs the real
``equalize_bshd`` / ``equalize_thd`` on two gloo ranks. Worker functions live at module level so
that spawned ranks can import them; this module imports nothing heavier than torch.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hybrid.padding import (
    bshd_pad,
    equalize_bshd,
    equalize_thd,
    extend_bshd,
    extend_thd,
    group_equalize,
    thd_pack,
)
from megatron_hybrid.testing.spawn import run_distributed

parallel = st.fixed_dictionaries(
    {
        "tp": st.sampled_from([1, 2, 4]),
        "cp": st.sampled_from([1, 2, 3]),
        "sp": st.booleans(),
        "quant": st.sampled_from([None, "delayed", "mxfp8", "nvfp4"]),
        "chunk": st.sampled_from([64, 128]),
    }
)
packs = st.lists(st.integers(1, 3000), min_size=1, max_size=6)
FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(
    cfg=parallel,
    batch_size=st.integers(1, 8),
    lens=st.lists(st.integers(1, 9000), min_size=2, max_size=8),
)
def test_g1_bshd_group_max(cfg, batch_size, lens):
    plans = [bshd_pad(cur_len=n, batch_size=batch_size, hybridep=True, **cfg) for n in lens]
    div = plans[0].divisible_by
    target = group_equalize([p.padded_len for p in plans], align=div)
    equal = [extend_bshd(p, target) for p in plans]
    counts = {p.per_rank_tokens for p in equal}
    assert len(counts) == 1 and counts.pop() % cfg["chunk"] == 0  # G1
    assert target == max(p.padded_len for p in plans)  # already aligned: nothing extra


@FAST
@given(cfg=parallel, ranks=st.lists(packs, min_size=2, max_size=8))
def test_g1_thd_group_max(cfg, ranks):
    plans = [thd_pack(lens, hybridep=True, **cfg) for lens in ranks]
    t = plans[0].total_multiple
    target = group_equalize([p.total_tokens for p in plans], align=t)
    equal = [extend_thd(p, target) for p in plans]
    counts = {p.per_rank_tokens for p in equal}
    assert len(counts) == 1 and counts.pop() % cfg["chunk"] == 0  # G1
    for plan, lens in zip(equal, ranks, strict=True):
        cp = cfg["cp"]
        assert plan.cu_seqlens_padded[-1] == target == sum(plan.padded_seqlens)
        assert cp == 1 or all(p % (2 * cp) == 0 for p in plan.padded_seqlens)  # T1 kept
        assert plan.padded_seqlens[:-1] == thd_pack(lens, hybridep=True, **cfg).padded_seqlens[:-1]


@pytest.mark.parametrize(
    "extend, plan, value, match",
    [
        (extend_bshd, dict(cur_len=100), 96, "must be >= 128"),
        (extend_bshd, dict(cur_len=100), 200, "a multiple of 128"),
        (extend_bshd, dict(cur_len=100, force_len=128), 256, "fixed padded_len 128"),
        (extend_thd, None, 256 + 64, "a multiple of 256"),
    ],
    ids=["shorter", "unaligned", "fixed", "thd-unaligned"],
)
def test_extension_errors(extend, plan, value, match):
    base = (
        bshd_pad(batch_size=1, tp=1, cp=1, sp=False, hybridep=True, **plan)
        if plan is not None
        else thd_pack([10], tp=2, cp=1, sp=True, hybridep=True)
    )
    with pytest.raises(ValueError, match=match):
        extend(base, value)


def test_group_equalize_errors():
    with pytest.raises(ValueError, match="per_rank_counts is empty"):
        group_equalize([])
    with pytest.raises(ValueError, match=r"per_rank_counts\[1\] must be an integer >= 0"):
        group_equalize([3, -1])
    assert group_equalize([0, 0]) == 0


def test_equalize_requires_a_group():
    plan = bshd_pad(cur_len=10, batch_size=1, tp=1, cp=1, sp=False, hybridep=True)
    with pytest.raises(ValueError, match="pg_collection.tp_ep"):
        equalize_bshd(plan, None)


def _equalize_worker(rank: int, world_size: int) -> dict:
    """Each rank plans different data, then one MAX all-reduce makes the counts equal."""
    group = dist.new_group(list(range(world_size)))
    common = dict(tp=2, cp=1, sp=True, hybridep=True)
    bshd = bshd_pad(cur_len=[1000, 3000][rank], batch_size=2, **common)
    thd = thd_pack([[100, 50], [700, 900, 20]][rank], **common)
    out = {
        "bshd": equalize_bshd(bshd, group).per_rank_tokens,
        "bshd_len": equalize_bshd(bshd, group).padded_len,
        "thd": equalize_thd(thd, group).per_rank_tokens,
        "thd_last": equalize_thd(thd, group).padded_seqlens[-1],
    }
    # A rank planning with another micro-batch size must fail on every rank, not hang.
    odd = bshd_pad(cur_len=1000, batch_size=[2, 3][rank], **common)
    try:
        equalize_bshd(odd, group)
    except ValueError as err:
        out["mismatch"] = str(err)
    # A fixed length that another rank exceeds is an error on every rank, too.
    fixed = bshd_pad(cur_len=100, batch_size=2, force_len=[1024, 2048][rank], **common)
    try:
        equalize_bshd(fixed, group)
    except ValueError as err:
        out["fixed"] = str(err)
    return out


@pytest.mark.distributed
def test_equalize_two_gloo_ranks():
    r0, r1 = run_distributed(_equalize_worker, 2)
    assert r0["bshd"] == r1["bshd"] == 2 * 3072 // 2 and r0["bshd_len"] == 3072
    assert r0["bshd"] % 128 == 0
    # THD: rank 1 packs 1620 tokens -> 1792; rank 0 (150 -> 256) grows its last sequence.
    assert r0["thd"] == r1["thd"] == 1792 // 2
    assert r0["thd_last"] == 1792 - 100 and r1["thd_last"] == 1792 - 1600
    for out in (r0, r1):
        assert "micro-batch size" in out["mismatch"]
        assert "fixed row length" in out["fixed"]

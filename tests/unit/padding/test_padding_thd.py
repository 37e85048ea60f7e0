"""THD planner: invariants T1-T5 (spec §7) under hypothesis, brute-force minimality, errors."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hybrid.padding import QUANT_ALIGN, THD_MODES, thd_pack


def examples(n: int) -> settings:
    """Hypothesis settings for fast pure-Python properties (no deadline: CI machines vary)."""
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def valid_total(total, *, tp, cp, sp, quant, hybridep, chunk, **_):
    """Invariants T2-T4 of a packed total (T1 is per sequence), from docs/padding.md §1."""
    q = QUANT_ALIGN[quant]
    d = cp * (tp if sp else 1)
    if total % cp:
        return False
    if sp and tp > 1 and (total // cp) % tp:  # T2
        return False
    if q > 1 and (total // cp) % q:  # T3
        return False
    if hybridep and (total % d or (total // d) % chunk):  # T4
        return False
    return True


configs = st.fixed_dictionaries(
    {
        "tp": st.sampled_from([1, 2, 3, 4, 8]),
        "cp": st.sampled_from([1, 2, 3, 4, 8]),
        "sp": st.booleans(),
        "quant": st.sampled_from(sorted(QUANT_ALIGN, key=str)),
        "hybridep": st.booleans(),
        "chunk": st.sampled_from([32, 64, 128, 256]),
        "mode": st.sampled_from(THD_MODES),
    }
)
seqlens = st.lists(st.integers(1, 5000), min_size=1, max_size=12)


@examples(1500)
@given(cfg=configs, lens=seqlens)
def test_invariants_t1_to_t5(cfg, lens):
    plan = thd_pack(lens, **cfg)
    total, cp = plan.total_tokens, cfg["cp"]
    if cp > 1:  # T1
        assert all(p % (2 * cp) == 0 for p in plan.padded_seqlens)
    assert valid_total(total, **cfg)  # T2-T4
    # T5: metadata shape and consistency.
    n = len(lens)
    assert plan.cu_seqlens_padded[-1] == total and plan.cu_seqlens[-1] == sum(lens)
    assert len(plan.cu_seqlens) == len(plan.cu_seqlens_padded) == n + 1
    assert all(p >= n_ for p, n_ in zip(plan.padded_seqlens, lens, strict=True))
    assert all(p % plan.seq_multiple == 0 for p in plan.padded_seqlens)
    assert plan.max_seqlen == max(plan.padded_seqlens)
    # Real boundaries never pass the padded ones: pads only follow real tokens.
    for i in range(n):
        assert plan.cu_seqlens_padded[i] + lens[i] <= plan.cu_seqlens_padded[i + 1]
    # T5 minimality: per-sequence pads are minimal and total is the next multiple of t.
    content = sum(-(-n_ // plan.seq_multiple) * plan.seq_multiple for n_ in lens)
    assert content <= total < content + plan.total_multiple and total % plan.total_multiple == 0
    d = cp * (cfg["tp"] if cfg["sp"] else 1)
    assert plan.per_rank_tokens * d == total and plan.tokens_per_cp_rank * cp == total
    if cfg["hybridep"]:
        assert plan.per_rank_tokens % cfg["chunk"] == 0


@examples(500)
@given(
    cfg=st.fixed_dictionaries(
        {
            "tp": st.integers(1, 4),
            "cp": st.integers(1, 4),
            "sp": st.booleans(),
            "quant": st.sampled_from([None, "delayed", "mxfp8"]),
            "hybridep": st.booleans(),
            "chunk": st.sampled_from([32, 64]),
        }
    ),
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
)
def test_minimal_total_against_brute_force(cfg, lens):
    """Search every per-sequence padding: total is the least total any valid packing can reach."""
    cp = cfg["cp"]
    s = 2 * cp if cp > 1 else 1

    def reachable(total: int) -> bool:
        # A packing exists iff each P_i >= L_i with s | P_i and sum P_i == total.
        least = sum(-(-n // s) * s for n in lens)
        return total >= least and total % s == 0

    plan = thd_pack(lens, mode="minimal", **cfg)
    brute = next(
        total for total in range(1, 10**6) if reachable(total) and valid_total(total, **cfg)
    )
    assert plan.total_tokens == brute


@examples(600)
@given(cfg=configs, lens=seqlens, force_total=st.integers(1, 200_000))
def test_forced_total(cfg, lens, force_total):
    free = thd_pack(lens, **cfg)
    t = free.total_multiple
    content = sum(-(-n // free.seq_multiple) * free.seq_multiple for n in lens)
    if force_total % t:
        with pytest.raises(ValueError, match=f"force_total={force_total} is not a multiple of {t}"):
            thd_pack(lens, force_total=force_total, **cfg)
    elif force_total < content:
        with pytest.raises(ValueError, match="more than force_total"):
            thd_pack(lens, force_total=force_total, **cfg)
    else:
        plan = thd_pack(lens, force_total=force_total, **cfg)
        assert plan.total_tokens == force_total and plan.forced
        assert plan.padded_seqlens[:-1] == free.padded_seqlens[:-1]
        assert valid_total(force_total, **cfg)


def test_round_up_policy_and_overflow():
    kwargs = dict(tp=2, cp=1, sp=True, hybridep=True)
    plan = thd_pack([100, 27], force_total=1000, force_policy="round_up", **kwargs)
    assert plan.total_tokens == 1024 and plan.rounded_up and plan.per_rank_tokens == 512
    with pytest.raises(ValueError, match="raise force_total to 512"):
        thd_pack([300, 27], force_total=256, **kwargs)


def test_last_sequence_absorbs_tail():
    """The tail goes to the last sequence (as verl's preprocess_packed_seqs does), not to a new
    pad sequence."""
    plan = thd_pack([5, 3, 9], tp=2, cp=2, sp=True, hybridep=True)
    assert plan.padded_seqlens == (8, 4, 500) and plan.cu_seqlens_padded == (0, 8, 12, 512)
    assert plan.breakdown == {"seq_multiple": 4, "sp_split": 4, "hybridep": 512}


@pytest.mark.parametrize(
    "mode, tp, cp, sp, expected",
    [
        ("minimal", 2, 2, True, 4),
        ("upstream", 2, 2, True, 8),
        ("upstream", 4, 1, False, 4),
        ("bridge_vlm", 2, 2, True, 4),
        ("bridge_vlm", 4, 1, True, 4),
        ("minimal", 4, 1, True, 1),
    ],
    ids=["minimal-cp2", "upstream-cp2", "upstream-tp4", "vlm-cp2", "vlm-tp4-sp", "minimal-cp1"],
)
def test_seq_multiple_per_mode(mode, tp, cp, sp, expected):
    assert thd_pack([7], tp=tp, cp=cp, sp=sp, mode=mode).seq_multiple == expected


@pytest.mark.parametrize(
    "seqlens, kwargs, match",
    [
        ([], {}, "seqlens is empty"),
        ([3, 0], {}, r"seqlens\[1\] must be an integer >= 1"),
        ("abc", {}, "seqlens must be a sequence of ints"),
        ([3], {"mode": "greedy"}, "mode must be one of"),
        ([3], {"force_total": 8, "force_policy": "overwrite"}, "force_policy must be one of"),
    ],
    ids=["empty", "zero-length", "string", "mode", "policy"],
)
def test_invalid_arguments(seqlens, kwargs, match):
    with pytest.raises(ValueError, match=match):
        thd_pack(seqlens, tp=1, cp=2, sp=False, **kwargs)


def test_error_names_the_hybridep_term():
    with pytest.raises(ValueError, match=r"HybridEP combine chunk 128 with D=4 .* \(1000 % 512"):
        thd_pack([10], tp=2, cp=2, sp=True, hybridep=True, force_total=1000)

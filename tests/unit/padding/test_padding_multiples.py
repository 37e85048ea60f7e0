"""BSHD planner: invariants I1-I6 (spec §7) under hypothesis, brute-force minimality, errors.

The oracle below restates each invariant directly from the spec, independently of the lcm
construction in ``multiples.py``; hypothesis then checks thousands of parallel configurations.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hybrid.padding import (
    QUANT_ALIGN,
    bshd_pad,
    hybridep_chunk,
    quant_align,
    seq_divisible_by,
)

QUANTS = sorted(QUANT_ALIGN, key=str)


def examples(n: int) -> settings:
    """Hypothesis settings for fast pure-Python properties (no deadline: CI machines vary)."""
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def valid_bshd(length, *, batch_size, tp, cp, sp, quant, hybridep, chunk, strict):
    """Invariants I1-I4 (labelled below) of a padded row length, from docs/padding.md §1."""
    b, q = batch_size, QUANT_ALIGN[quant]
    base = 2 * tp * cp if cp > 1 else tp
    if cp > 1 and length % (2 * cp):  # I1
        return False
    if sp and tp > 1 and (length % cp or (length // cp) % tp):  # I2
        return False
    if length % base:  # I2 (base)
        return False
    if q > 1 and length % q:  # I3
        return False
    if q > 1 and strict and ((b * length) % cp or (b * length // cp) % q):  # I3 strict
        return False
    if hybridep:  # I4
        d = cp * (tp if sp else 1)
        if (b * length) % d or (b * length // d) % chunk:
            return False
    return True


configs = st.fixed_dictionaries(
    {
        "batch_size": st.one_of(st.integers(1, 16), st.sampled_from([24, 96, 128, 192, 256, 300])),
        "tp": st.sampled_from([1, 2, 3, 4, 8]),
        "cp": st.sampled_from([1, 2, 3, 4, 8]),
        "sp": st.booleans(),
        "quant": st.sampled_from(QUANTS),
        "hybridep": st.booleans(),
        "chunk": st.sampled_from([32, 64, 128, 256]),
        "strict": st.booleans(),
    }
)
small_configs = st.fixed_dictionaries(
    {
        "batch_size": st.integers(1, 12),
        "tp": st.integers(1, 4),
        "cp": st.integers(1, 4),
        "sp": st.booleans(),
        "quant": st.sampled_from([None, "delayed", "mxfp8"]),
        "hybridep": st.booleans(),
        "chunk": st.sampled_from([32, 64, 128]),
        "strict": st.booleans(),
    }
)


def plan_for(cfg, **kwargs):
    args = {k: v for k, v in cfg.items() if k != "strict"}
    return bshd_pad(strict_quant_per_rank=cfg["strict"], **args, **kwargs)


@examples(2000)
@given(cfg=configs, cur_len=st.integers(1, 40_000))
def test_invariants_i1_to_i5(cfg, cur_len):
    plan = plan_for(cfg, cur_len=cur_len)
    length, div = plan.padded_len, plan.divisible_by
    assert valid_bshd(length, **cfg)  # I1-I4
    # I5: the result is a multiple of div and the previous multiple is too short.
    assert length >= cur_len and length - div < cur_len and length % div == 0
    # The multiple is the lcm of the reported terms.
    assert div == math.lcm(1, *plan.breakdown.values())
    d = cfg["cp"] * (cfg["tp"] if cfg["sp"] else 1)
    assert plan.local_token_divisor == d
    assert plan.per_rank_tokens * d == cfg["batch_size"] * length
    assert plan.gemm_rows * cfg["cp"] == cfg["batch_size"] * length
    if cfg["hybridep"]:
        assert plan.per_rank_tokens % cfg["chunk"] == 0
    assert not plan.truncated and not plan.forced and plan.effective_seq_length == length


@examples(600)
@given(cfg=small_configs, cur_len=st.integers(1, 3000))
def test_minimal_against_brute_force(cfg, cur_len):
    plan = plan_for(cfg, cur_len=cur_len)
    brute = next(s for s in range(cur_len, cur_len + 10**6) if valid_bshd(s, **cfg))
    assert plan.padded_len == brute
    # The valid lengths are exactly the multiples of divisible_by.
    div = plan.divisible_by
    assert [s for s in range(1, 2 * div + 1) if valid_bshd(s, **cfg)] == [div, 2 * div]


@examples(1000)
@given(cfg=configs, force_len=st.integers(1, 40_000), cur_len=st.integers(1, 40_000))
def test_invariant_i6_forced_length(cfg, force_len, cur_len):
    div = plan_for(cfg, cur_len=1).divisible_by
    if force_len % div:
        with pytest.raises(ValueError, match=f"seq_length={force_len} is not a multiple of {div}"):
            plan_for(cfg, cur_len=cur_len, force_len=force_len)
        rounded = plan_for(cfg, cur_len=cur_len, force_len=force_len, force_policy="round_up")
        assert rounded.rounded_up and rounded.padded_len == -(-force_len // div) * div
    else:
        plan = plan_for(cfg, cur_len=cur_len, force_len=force_len)
        assert plan.padded_len == force_len and valid_bshd(force_len, **cfg)  # I6
        assert plan.truncated == (cur_len > force_len) and plan.forced and not plan.rounded_up


def test_pr3294_failure_is_aligned():
    """PR #3294: tp1 ep8 mbs4, length 1776 gave 7104 tokens per rank, 7104 % 128 = 64."""
    plan = bshd_pad(cur_len=1776, batch_size=4, tp=1, cp=1, sp=False, hybridep=True)
    assert plan.padded_len == 1792 and plan.per_rank_tokens == 7168
    assert plan.per_rank_tokens % 128 == 0 and plan.breakdown == {"hybridep": 32}
    # Bridge's unconditional fp8 padding (16) does not change the answer here.
    legacy = bshd_pad(
        cur_len=1776, batch_size=4, tp=1, cp=1, sp=False, quant="fp8_legacy16", hybridep=True
    )
    assert legacy.padded_len == 1792


def _upstream_overwrite(cur_len: int, divisible_by: int, seq_length: int, force: bool) -> int:
    """Megatron-Bridge PR #3294's first commit (e6e9be4f3, ``qwen3_vl_step.py``): force
    overwrites the aligned length."""
    target = -(-cur_len // divisible_by) * divisible_by
    if force:
        target = seq_length
    return target


def test_force_overwrite_bug_is_not_repeated():
    """Upstream forced seq_length=1776 silently (EP>1 forces it); 4*1776 % 128 != 0 (I4)."""
    div = seq_divisible_by(batch_size=4, tp=1, cp=1, sp=False, hybridep=True)
    buggy = _upstream_overwrite(1500, div, seq_length=1776, force=True)
    assert (4 * buggy) % 128 == 64  # the silent violation
    with pytest.raises(ValueError, match=r"HybridEP combine chunk 128 with D=1 and micro-batch 4"):
        bshd_pad(cur_len=1500, batch_size=4, tp=1, cp=1, sp=False, hybridep=True, force_len=1776)
    fixed = bshd_pad(
        cur_len=1500,
        batch_size=4,
        tp=1,
        cp=1,
        sp=False,
        hybridep=True,
        force_len=1776,
        force_policy="round_up",
    )
    assert fixed.padded_len == 1792 and fixed.rounded_up and fixed.per_rank_tokens % 128 == 0


@pytest.mark.parametrize(
    "kwargs, multiple, reason",
    [
        (dict(batch_size=4, tp=2, cp=1, sp=True, hybridep=True), 64, "D=2 and micro-batch 4"),
        (dict(batch_size=1, tp=2, cp=2, sp=True), 8, "cp=2 cuts each row into 4 chunks"),
        (dict(batch_size=1, tp=1, cp=1, sp=False, quant="mxfp8"), 32, "mxfp8 quantisation"),
        (dict(batch_size=1, tp=1, cp=4, sp=False, quant="delayed"), 16, "delayed quantisation"),
    ],
    ids=["hybridep-tp2-sp", "cp2-zigzag", "mxfp8", "fp8-cp4"],
)
def test_error_names_the_constraint(kwargs, multiple, reason):
    plan = bshd_pad(cur_len=1, **kwargs)
    bad = plan.divisible_by * 3 + plan.divisible_by // 2
    assert multiple in plan.breakdown.values()
    with pytest.raises(ValueError, match=reason):
        bshd_pad(cur_len=1, force_len=bad, **kwargs)


def test_strict_quant_per_rank_fixes_u12():
    """cp=4, B=1, S=1040 satisfies lcm(8, 16) but gives 260 FP8 GEMM rows per rank."""
    loose = bshd_pad(cur_len=1040, batch_size=1, tp=1, cp=4, sp=False, quant="delayed")
    strict = bshd_pad(
        cur_len=1040,
        batch_size=1,
        tp=1,
        cp=4,
        sp=False,
        quant="delayed",
        strict_quant_per_rank=True,
    )
    assert loose.padded_len == 1040 and loose.gemm_rows % 8 == 4
    assert strict.padded_len == 1088 and strict.gemm_rows % 16 == 0
    assert strict.breakdown["quant_per_rank"] == 64


@pytest.mark.parametrize(
    "batch_size, cp, expected",
    [(3, 1, 128), (6, 1, 64), (12, 3, 32), (256, 1, 1), (192, 1, 2)],
    ids=["B3", "B6", "B12-cp3", "B256", "B192"],
)
def test_hybridep_term_for_odd_batch_sizes(batch_size, cp, expected):
    """Spec §8: gcd handles B that are not powers of two and B larger than the chunk."""
    plan = bshd_pad(cur_len=1, batch_size=batch_size, tp=1, cp=cp, sp=False, hybridep=True)
    assert plan.breakdown["hybridep"] == expected


def test_result_supports_field_names():
    plan = bshd_pad(cur_len=100, batch_size=2, tp=2, cp=1, sp=True)
    for name in (
        "divisible_by",
        "padded_len",
        "truncated",
        "per_rank_tokens",
        "local_token_divisor",
        "effective_seq_length",
    ):
        assert plan[name] == getattr(plan, name)
    with pytest.raises(KeyError, match="not a field of BshdPlan"):
        plan["nope"]
    with pytest.raises(AttributeError):
        plan.padded_len = 3  # frozen


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cur_len=0), "cur_len must be an integer >= 1"),
        (dict(cur_len=10, tp=0), "tp must be an integer >= 1"),
        (dict(cur_len=10, cp=1.5), "cp must be an integer >= 1"),
        (dict(cur_len=10, sp=1), "sp must be True or False"),
        (dict(cur_len=10, batch_size=True), "batch_size must be an integer"),
        (dict(cur_len=10, quant="fp8"), "unknown quantisation recipe 'fp8'"),
        (dict(cur_len=10, force_len=16, force_policy="legacy_overwrite"), "deliberately not"),
        (dict(cur_len=10, chunk=0), "chunk must be an integer >= 1"),
    ],
    ids=["cur_len", "tp", "cp-float", "sp-int", "batch-bool", "quant", "legacy", "chunk"],
)
def test_invalid_arguments(kwargs, match):
    args = dict(batch_size=1, tp=1, cp=1, sp=False) | kwargs
    with pytest.raises(ValueError, match=match):
        bshd_pad(**args)


@pytest.mark.parametrize(
    "name, expected",
    [(None, 1), ("bf16", 1), ("tensorwise", 16), ("blockwise", 16), ("custom", 16), ("mxfp8", 32)]
    + [("nvfp4", 128), ("fp8_legacy16", 16), ("delayed", 16)],
    ids=lambda v: str(v),
)
def test_quant_align(name, expected):
    assert quant_align(name) == expected


def test_quant_align_accepts_megatron_enums():
    from megatron.core.enums import Fp4Recipe, Fp8Recipe

    assert quant_align(Fp8Recipe.mxfp8) == 32 and quant_align(Fp4Recipe.nvfp4) == 128


@pytest.mark.parametrize(
    "chunk, env, expected",
    [(None, None, 128), (64, None, 64), (None, "64", 128), (64, "128", 128), (None, "384", 384)],
    ids=["default", "override", "env64", "env-wins", "env384"],
)
def test_hybridep_chunk(chunk, env, expected):
    environ = {} if env is None else {"NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": env}
    assert hybridep_chunk(chunk, environ=environ) == expected


@pytest.mark.parametrize(
    "env",
    ["48", "abc", "-64", "0", "\u0663\u0662", "\uff16\uff14"],
    ids=["not32", "text", "neg", "zero", "arabic-indic-32", "fullwidth-64"],
)
def test_hybridep_chunk_rejects_bad_env(env):
    with pytest.raises(ValueError, match="NUM_OF_TOKENS_PER_CHUNK_COMBINE_API"):
        hybridep_chunk(environ={"NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": env})


def test_hybridep_chunk_reads_os_environ(monkeypatch):
    monkeypatch.setenv("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", "256")
    assert hybridep_chunk() == 256

"""THD (packed) planning: pad each sequence and the packed total for TP/SP, CP, FP8/FP4, HybridEP.

Builds on the shared terms in
:mod:`~megatron_hybrid.padding.multiples` (pure Python, no torch). Sequences of lengths ``L_i``
are each padded to a multiple ``s`` (the *mode* decides it) and packed into one ``[1, T]`` row
whose total ``T`` is a multiple of ``t``, the lcm of every term; the last sequence absorbs the
tail. :class:`ThdPlan` carries the resulting ``cu_seqlens`` and per-rank counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_hybrid.checks import check_int
from megatron_hybrid.padding.multiples import (
    DEFAULT_HYBRIDEP_CHUNK,
    Constraint,
    PaddingResult,
    check_parallel,
    check_policy,
    fixed_length,
    quant_align,
    round_up,
)

# Public surface; names starting with "_" are implementation details.
__all__ = ["THD_MODES", "ThdPlan", "thd_pack"]

THD_MODES = ("minimal", "upstream", "bridge_vlm")


@dataclass(frozen=True, kw_only=True)
class ThdPlan(PaddingResult):
    """How to pack sequences into one ``[1, T]`` row; returned by :func:`thd_pack`.

    Fields: ``seq_multiple`` (s), ``total_multiple`` (t), ``padded_seqlens`` (P_i; the
    last absorbs the tail), ``cu_seqlens`` (real boundaries), ``cu_seqlens_padded`` (physical
    offsets, ending at T), ``max_seqlen`` (max P_i), ``total_tokens`` (T), ``per_rank_tokens``
    (T/D) and ``effective_seq_length`` (T). Also: ``seqlens`` (L_i), ``local_token_divisor`` (D),
    ``cp``, ``tokens_per_cp_rank`` (T/cp), ``forced``, ``rounded_up`` and ``constraints``.
    """

    seq_multiple: int
    total_multiple: int
    padded_seqlens: tuple[int, ...]
    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]
    max_seqlen: int
    total_tokens: int
    per_rank_tokens: int
    effective_seq_length: int
    seqlens: tuple[int, ...]
    local_token_divisor: int
    cp: int
    tokens_per_cp_rank: int
    forced: bool = False
    rounded_up: bool = False
    constraints: tuple[Constraint, ...] = field(default=(), repr=False)


def _thd_terms(
    tp: Any, cp: Any, sp: Any, quant: Any, hybridep: Any, chunk: Any, mode: str
) -> tuple[Constraint, ...]:
    """The THD terms; the first is the per-sequence multiple ``s``."""
    where = "thd_pack"
    tp, cp, sp, chunk, hybridep = check_parallel(tp, cp, sp, chunk, hybridep, where)
    q = quant_align(quant)
    zigzag = 2 * cp if cp > 1 else 1
    if mode == "minimal":
        # The only per-document requirement: each document is cut into 2*cp chunks
        # (megatron-core 0.19.2 utils.py, through TE's thd_get_partitioned_indices).
        s, why = zigzag, f"CP load balancing over cp={cp} cuts each sequence into {zigzag} chunks"
    elif mode == "upstream":
        s, why = (2 * tp * cp if cp > 1 else tp), f"upstream (verl/AReaL) rule for tp={tp}, cp={cp}"
    elif mode == "bridge_vlm":
        s = math.lcm(zigzag, cp * tp if sp and tp > 1 else 1)
        why = f"Megatron-Bridge vlm_step rule lcm(2*cp, cp*tp if sp) for tp={tp}, cp={cp}"
    else:
        raise ValueError(f"{where}: mode must be one of {THD_MODES}, got {mode!r}")
    terms = [Constraint("seq_multiple", s, f"{why}: each sequence padded to a multiple of {s}")]
    if sp and tp > 1:
        why = f"SP splits the T/cp tokens of each CP rank over tp={tp}: requires a multiple of"
        terms.append(Constraint("sp_split", cp * tp, f"{why} cp*tp={cp * tp}"))
    if q > 1:
        why = f"{quant} GEMM rows T/cp with cp={cp} require a multiple of"
        terms.append(Constraint("quant", q * cp, f"{why} q*cp={q * cp}"))
    if hybridep:
        d = cp * (tp if sp else 1)
        why = f"HybridEP combine chunk {chunk} with D={d} requires a multiple of"
        terms.append(Constraint("hybridep", chunk * d, f"{why} {chunk * d}"))
    return tuple(terms)


def thd_pack(
    seqlens: Sequence[int],
    *,
    tp: int,
    cp: int,
    sp: bool,
    quant: str | None = None,
    hybridep: bool = False,
    chunk: int = DEFAULT_HYBRIDEP_CHUNK,
    mode: str = "minimal",
    force_total: int | None = None,
    force_policy: str = "raise",
) -> ThdPlan:
    """Plan packing sequences of lengths ``seqlens`` into one ``[1, T]`` row.

    Each sequence is padded to ``P_i = ceil(L_i / s) * s``; ``T`` is the least multiple of ``t``
    that holds them (or ``force_total``), and the last sequence absorbs ``T - sum(P_i)``.

    Args:
        seqlens: the real lengths ``L_i`` (each >= 1).
        mode: per-sequence multiple: ``"minimal"`` (2*cp), ``"upstream"`` or ``"bridge_vlm"``.
        force_total: a fixed ``T``, or None.
        force_policy: ``"raise"`` (default) or ``"round_up"``.
        tp, cp, sp, quant, hybridep, chunk: as in :func:`seq_divisible_by`.

    Raises:
        ValueError: invalid arguments, an unaligned ``force_total`` under ``"raise"``, or
            sequences that do not fit in ``force_total``.

    >>> plan = thd_pack([5, 3, 9], tp=2, cp=2, sp=True, hybridep=True)
    >>> plan.padded_seqlens, plan.cu_seqlens, plan.cu_seqlens_padded, plan.per_rank_tokens
    ((8, 4, 500), (0, 5, 8, 17), (0, 8, 12, 512), 128)
    """
    where = "thd_pack"
    policy = check_policy(force_policy, where)
    terms = _thd_terms(tp, cp, sp, quant, hybridep, chunk, mode)
    if isinstance(seqlens, (str, bytes)) or not isinstance(seqlens, Iterable):
        raise ValueError(f"{where}: seqlens must be a sequence of ints, got {seqlens!r}")
    lens = tuple(check_int(f"seqlens[{i}]", n, 1, where=where) for i, n in enumerate(seqlens))
    if not lens:
        raise ValueError(f"{where}: seqlens is empty; pack at least one sequence")
    s, t = terms[0].multiple, math.lcm(*(c.multiple for c in terms))
    padded = [round_up(n, s) for n in lens]
    content = sum(padded)
    if force_total is None:
        total, rounded = round_up(content, t), False
    else:
        total, rounded = fixed_length(force_total, t, terms, policy, "force_total")
        if total < content:
            raise ValueError(
                f"{where}: {len(lens)} sequences ({sum(lens)} tokens) need {content} tokens after "
                f"padding each to a multiple of {s}, more than force_total={total}. Pack fewer "
                f"sequences per micro-batch or raise force_total to {round_up(content, t)}."
            )
    # The tail is a multiple of s (both totals are), so the last sequence stays 2*cp-aligned.
    padded[-1] += total - content
    d = cp * (tp if sp else 1)
    assert total % d == 0 and total % cp == 0 and padded[-1] % s == 0, (total, d, s)
    return ThdPlan(
        seq_multiple=s,
        total_multiple=t,
        padded_seqlens=tuple(padded),
        cu_seqlens=_cumsum(lens),
        cu_seqlens_padded=_cumsum(padded),
        max_seqlen=max(padded),
        total_tokens=total,
        per_rank_tokens=total // d,
        effective_seq_length=total,
        seqlens=lens,
        local_token_divisor=d,
        cp=cp,
        tokens_per_cp_rank=total // cp,
        forced=force_total is not None,
        rounded_up=rounded,
        constraints=terms,
    )


def _cumsum(values: Iterable[int]) -> tuple[int, ...]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)

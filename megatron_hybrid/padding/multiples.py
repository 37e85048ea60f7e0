"""Least sequence multiples for TP/SP, CP, FP8/FP4 and HybridEP (pure Python, no torch).

The BSHD planner and the group maximum (the THD planner is in :mod:`~megatron_hybrid.padding.thd`
and builds on the terms here); ``docs/padding.md`` lists every term with its upstream source. Every
requirement has the form "x divides the padded length", so the least valid length is a round-up to
the lcm of the terms. Each term is a :class:`Constraint` with its name, its multiple and a sentence
saying which setting forced it, so an error reads "HybridEP combine chunk 128 with D=2 and
micro-batch 4 requires a multiple of 64" rather than only "must be divisible by 64".

Vocabulary: ``S`` is a BSHD row length, ``B`` the micro-batch size, ``T`` the packed (THD) token
count, ``D = cp * (tp if sp else 1)`` how often a row is split before MoE dispatch, ``q`` the
quantisation multiple and ``chunk`` the HybridEP combine chunk.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

# Public surface; names starting with "_" are implementation details.
from megatron_hybrid.checks import check_int

__all__ = [
    "CHUNK_ENV_VAR",
    "DEFAULT_HYBRIDEP_CHUNK",
    "FORCE_POLICIES",
    "QUANT_ALIGN",
    "BshdPlan",
    "Constraint",
    "bshd_pad",
    "group_equalize",
    "hybridep_chunk",
    "quant_align",
    "seq_divisible_by",
]

# 128 is safe for both historical DeepEP defaults (128 until DeepEP commit a0d27f1, 64 after).
DEFAULT_HYBRIDEP_CHUNK = 128
# The DeepEP variable that sets the combine chunk (hybrid-ep ``csrc/hybrid_ep/config.cuh``).
CHUNK_ENV_VAR = "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API"
# megatron-core 0.19.2 fp8_utils.get_fp8_align_size (mxfp8 32, other FP8 16), fp4_utils (NVFP4 128).
# "fp8_legacy16" is Megatron-Bridge #3294's unconditional use_fp8_padding=True (16 even for bf16).
QUANT_ALIGN: Mapping[str | None, int] = MappingProxyType(
    {None: 1, "bf16": 1, "mxfp8": 32, "nvfp4": 128}
    | dict.fromkeys(("delayed", "tensorwise", "blockwise", "custom", "fp8_legacy16"), 16)
)
FORCE_POLICIES = ("raise", "round_up")


def check_flag(name: str, value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be True or False, got {value!r}")
    return value


def check_policy(force_policy: str, where: str) -> str:
    if force_policy not in FORCE_POLICIES:
        raise ValueError(
            f"{where}: force_policy must be one of {FORCE_POLICIES}, got {force_policy!r}. "
            "Overwriting the aligned length with the fixed one (upstream's 'legacy_overwrite', "
            "Megatron-Bridge #3294) is deliberately not offered: it breaks HybridEP silently."
        )
    return force_policy


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def quant_align(quant: str | None) -> int:
    """Return the sequence multiple a quantisation recipe needs.

    Args:
        quant: None or ``"bf16"`` (none), an FP8 recipe (``"delayed"``, ``"tensorwise"``,
            ``"blockwise"``, ``"custom"``, ``"mxfp8"``), ``"nvfp4"`` or ``"fp8_legacy16"``
            (upstream's unconditional 16). Megatron's ``Fp8Recipe``/``Fp4Recipe`` work too.

    Raises:
        ValueError: unknown recipe name.

    >>> quant_align(None), quant_align("delayed"), quant_align("mxfp8"), quant_align("nvfp4")
    (1, 16, 32, 128)
    """
    key = getattr(quant, "value", quant)
    if key not in QUANT_ALIGN:
        names = ", ".join(repr(k) for k in QUANT_ALIGN)
        raise ValueError(f"unknown quantisation recipe {quant!r}; expected one of {names}")
    return QUANT_ALIGN[key]


def hybridep_chunk(chunk: int | None = None, *, environ: Mapping[str, str] | None = None) -> int:
    """Return the HybridEP combine chunk that padding must honour.

    DeepEP compiles the combine kernel with ``NUM_OF_TOKENS_PER_CHUNK_COMBINE_API`` when it is
    set, so the result is ``lcm(chunk or 128, env)`` then, else ``chunk or 128``. Pass
    ``chunk=64`` only when the pinned DeepEP is at or after a0d27f1 and the variable is unset.

    Args:
        chunk: overrides the default 128.
        environ: the environment to read (default ``os.environ``).

    Raises:
        ValueError: ``chunk`` or the variable is not a positive integer, or the variable is not a
            multiple of 32 (a DeepEP ``static_assert`` in ``hybrid_ep_backend.cuh``).

    >>> hybridep_chunk(environ={}), hybridep_chunk(64, environ={})
    (128, 64)
    >>> hybridep_chunk(64, environ={"NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": "128"})
    128
    """
    base = (
        DEFAULT_HYBRIDEP_CHUNK
        if chunk is None
        else check_int("chunk", chunk, 1, where="hybridep_chunk")
    )
    raw = (os.environ if environ is None else environ).get(CHUNK_ENV_VAR, "").strip()
    if not raw:
        return base
    # str.isdigit and int() also take non-ASCII digits ('٣٢' reads as 32); DeepEP's build does not.
    env_chunk = int(raw) if raw.isascii() and raw.isdigit() else 0
    if env_chunk < 32 or env_chunk % 32:
        raise ValueError(
            f"{CHUNK_ENV_VAR}={raw!r} is invalid: DeepEP HybridEP needs a positive multiple of 32 "
            "('NUM_OF_TOKENS_PER_CHUNK must be multiple of 32'); unset it or use e.g. 128"
        )
    return math.lcm(base, env_chunk)


@dataclass(frozen=True)
class Constraint:
    """One requirement on the padded length: ``multiple`` must divide it.

    Attributes:
        name: stable key: ``"tp_split"``, ``"cp_zigzag"``, ``"quant"``, ``"quant_per_rank"``,
            ``"hybridep"``; THD adds ``"seq_multiple"`` and ``"sp_split"``.
        multiple: the multiple this term alone requires.
        reason: a sentence naming the setting and the numbers behind ``multiple``.
    """

    name: str
    multiple: int
    reason: str


def _violated(constraints: Iterable[Constraint], length: int) -> str:
    """The reasons of the terms ``length`` violates, each with its remainder."""
    return "; ".join(
        f"{c.reason} ({length} % {c.multiple} = {length % c.multiple})"
        for c in constraints
        if length % c.multiple
    )


class PaddingResult:
    """Dict-style read access (``plan["padded_len"]``), for callers that pass results as dicts."""

    constraints: tuple[Constraint, ...]

    def __getitem__(self, key: str) -> Any:
        names = tuple(f.name for f in fields(self)) + ("breakdown",)
        if key not in names:
            raise KeyError(f"{key!r} is not a field of {type(self).__name__}; fields: {names}")
        return getattr(self, key)

    @property
    def breakdown(self) -> dict[str, int]:
        """``constraint name -> multiple`` for every term that applied."""
        return {c.name: c.multiple for c in self.constraints}


@dataclass(frozen=True, kw_only=True)
class BshdPlan(PaddingResult):
    """How to pad a ``[B, S]`` micro-batch; returned by :func:`bshd_pad`.

    ``divisible_by``, ``padded_len`` (S_pad), ``truncated``, ``per_rank_tokens`` (``B*S_pad/D``,
    what HybridEP dispatches per rank), ``local_token_divisor`` (D) and ``effective_seq_length``
    (the length the model runs with; under a fixed length, what ``config.seq_length`` must equal)
    are the planner's answer. Also: ``cur_len``, ``batch_size``, ``cp``, ``gemm_rows``
    (``B*S_pad/cp``, the TE GEMM rows per rank), ``forced``, ``rounded_up`` (write
    ``effective_seq_length`` back to the config) and ``constraints``.
    """

    divisible_by: int
    padded_len: int
    truncated: bool
    per_rank_tokens: int
    local_token_divisor: int
    effective_seq_length: int
    cur_len: int
    batch_size: int
    cp: int
    gemm_rows: int
    forced: bool = False
    rounded_up: bool = False
    constraints: tuple[Constraint, ...] = field(default=(), repr=False)


def check_parallel(tp: Any, cp: Any, sp: Any, chunk: Any, hybridep: Any, where: str) -> tuple:
    """Validate the arguments shared by the BSHD and THD planners."""
    tp, cp, chunk = (
        check_int(n, v, 1, where=where) for n, v in (("tp", tp), ("cp", cp), ("chunk", chunk))
    )
    return tp, cp, check_flag("sp", sp, where), chunk, check_flag("hybridep", hybridep, where)


def _seq_terms(
    batch_size: Any, tp: Any, cp: Any, sp: Any, quant: Any, hybridep: Any, chunk: Any, strict: Any
) -> tuple[Constraint, ...]:
    """The BSHD terms whose lcm is :func:`seq_divisible_by`."""
    where = "seq_divisible_by"
    b = check_int("batch_size", batch_size, 1, where=where)
    tp, cp, sp, chunk, hybridep = check_parallel(tp, cp, sp, chunk, hybridep, where)
    strict = check_flag("strict_quant_per_rank", strict, where)
    q = quant_align(quant)
    terms = []
    if cp > 1:
        # Zig-zag CP cuts a row into 2*cp chunks; upstream keeps each shard divisible by tp
        # (megatron-core 0.19.2 utils.py).
        m = 2 * tp * cp
        why = f"CP load balancing over cp={cp} cuts each row into {2 * cp} chunks, each split"
        terms.append(Constraint("cp_zigzag", m, f"{why} over tp={tp}: requires a multiple of {m}"))
    elif tp > 1:
        # The SP scatter asserts dim0 % tp == 0 (tensor_parallel/mappings.py); upstream applies it
        # even without SP.
        why = f"TP/SP split over tp={tp} requires a multiple of {tp}"
        terms.append(Constraint("tp_split", tp, why))
    if q > 1:
        terms.append(Constraint("quant", q, f"{quant} quantisation requires a multiple of {q}"))
        if strict:
            # Per-rank GEMM rows: q | B*S/cp <=> (q*cp / gcd(B, q*cp)) | S; lcm(8, 16) alone
            # misses it (cp=4, B=1, S=1040 gives 260 rows).
            m = (q * cp) // math.gcd(b, q * cp)
            why = f"{quant} GEMM rows per rank (B*S/cp, cp={cp}, micro-batch {b}) require"
            terms.append(Constraint("quant_per_rank", m, f"{why} a multiple of {m}"))
    if hybridep:
        # chunk | B*S/D <=> chunk*D | B*S <=> (chunk*D / gcd(B, chunk*D)) | S.
        d = cp * (tp if sp else 1)
        m = (chunk * d) // math.gcd(b, chunk * d)
        why = f"HybridEP combine chunk {chunk} with D={d} and micro-batch {b} requires"
        terms.append(Constraint("hybridep", m, f"{why} a multiple of {m}"))
    return tuple(terms)


def seq_divisible_by(
    *,
    batch_size: int,
    tp: int,
    cp: int,
    sp: bool,
    quant: str | None = None,
    hybridep: bool = False,
    chunk: int = DEFAULT_HYBRIDEP_CHUNK,
    strict_quant_per_rank: bool = False,
) -> int:
    """Return the least multiple every padded BSHD row length must have.

    Args:
        batch_size: rows in the micro-batch (``B``).
        tp: attention tensor-parallel size.
        cp: context-parallel size (odd values allowed).
        sp: sequence parallelism (no effect when ``tp == 1``).
        quant: quantisation recipe, see :func:`quant_align`.
        hybridep: the MoE dispatcher is flex + HybridEP.
        chunk: HybridEP combine chunk, see :func:`hybridep_chunk`.
        strict_quant_per_rank: also make the per-rank GEMM rows ``B*S/cp`` a multiple of ``q``.

    Raises:
        ValueError: an argument is not a positive integer / bool, or the recipe is unknown.

    >>> seq_divisible_by(batch_size=4, tp=1, cp=1, sp=False, hybridep=True)  # PR #3294 case
    32
    >>> seq_divisible_by(batch_size=1, tp=2, cp=2, sp=True, quant="mxfp8")
    32
    """
    terms = _seq_terms(batch_size, tp, cp, sp, quant, hybridep, chunk, strict_quant_per_rank)
    return math.lcm(1, *(c.multiple for c in terms))


def fixed_length(
    force: Any, multiple: int, terms: Sequence[Constraint], policy: str, what: str
) -> tuple:
    """Apply a force policy to a fixed length; return ``(length, rounded_up)``."""
    where = "thd_pack" if what == "force_total" else "bshd_pad"
    force = check_int(what, force, 1, where=where)
    if force % multiple == 0:
        return force, False
    if policy == "round_up":
        return round_up(force, multiple), True
    below = force - force % multiple
    options = f"{round_up(force, multiple)}" + (f" or {below}" if below else "")
    raise ValueError(
        f"{where}: {what}={force} is not a multiple of {multiple}: {_violated(terms, force)}. "
        f"Set {what} to {options}, or pass force_policy='round_up' at setup time and write the "
        "result back to the config before pipeline shapes are computed."
    )


def bshd_pad(
    *,
    cur_len: int,
    batch_size: int,
    tp: int,
    cp: int,
    sp: bool,
    quant: str | None = None,
    hybridep: bool = False,
    chunk: int = DEFAULT_HYBRIDEP_CHUNK,
    strict_quant_per_rank: bool = False,
    force_len: int | None = None,
    force_policy: str = "raise",
) -> BshdPlan:
    """Plan the padding of a ``[B, S]`` micro-batch.

    Without ``force_len`` rows are padded to the least valid length ``>= cur_len``. With it (PP > 1
    without ``variable_seq_lengths``, or fixed-shape HybridEP) every row gets exactly
    ``force_len`` tokens; an unaligned ``force_len`` raises (``"raise"``) or is rounded up
    (``"round_up"``, at setup time only: write ``effective_seq_length`` back to the config). Rows
    longer than the fixed length are truncated (``truncated=True``).

    Args:
        cur_len: longest row before padding (``S``).
        force_len: a fixed row length, or None.
        force_policy: ``"raise"`` (default) or ``"round_up"``.
        batch_size, tp, cp, sp, quant, hybridep, chunk, strict_quant_per_rank: as in
            :func:`seq_divisible_by`.

    Raises:
        ValueError: invalid arguments, or an unaligned ``force_len`` under ``"raise"``; the
            message names each violated constraint.

    >>> plan = bshd_pad(cur_len=1776, batch_size=4, tp=1, cp=1, sp=False, hybridep=True)
    >>> plan.padded_len, plan.per_rank_tokens, plan["divisible_by"]
    (1792, 7168, 32)
    >>> bshd_pad(cur_len=1000, batch_size=4, tp=1, cp=1, sp=False, hybridep=True, force_len=1776)
    Traceback (most recent call last):
    ValueError: bshd_pad: seq_length=1776 is not a multiple of 32: HybridEP combine chunk 128 with \
D=1 and micro-batch 4 requires a multiple of 32 (1776 % 32 = 16). Set seq_length to 1792 or 1760, \
or pass force_policy='round_up' at setup time and write the result back to the config before \
pipeline shapes are computed.
    """
    cur_len = check_int("cur_len", cur_len, 1, where="bshd_pad")
    policy = check_policy(force_policy, "bshd_pad")
    terms = _seq_terms(batch_size, tp, cp, sp, quant, hybridep, chunk, strict_quant_per_rank)
    div = math.lcm(1, *(c.multiple for c in terms))
    if force_len is None:
        padded, rounded = round_up(cur_len, div), False
    else:
        padded, rounded = fixed_length(force_len, div, terms, policy, "seq_length")
    d = cp * (tp if sp else 1)
    # The tp/cp term makes D and cp divide S_pad, so the per-rank counts are exact.
    assert padded % d == 0 and padded % cp == 0, (padded, d, cp)
    return BshdPlan(
        divisible_by=div,
        padded_len=padded,
        truncated=cur_len > padded,
        per_rank_tokens=batch_size * padded // d,
        local_token_divisor=d,
        effective_seq_length=padded,
        cur_len=cur_len,
        batch_size=batch_size,
        cp=cp,
        gemm_rows=batch_size * padded // cp,
        forced=force_len is not None,
        rounded_up=rounded,
        constraints=terms,
    )


def group_equalize(per_rank_counts: Iterable[int], align: int = DEFAULT_HYBRIDEP_CHUNK) -> int:
    """Return the count every rank pads to: the group maximum rounded up to ``align`` (§6).

    Only the maximum matters, so ``group_equalize(c) == group_equalize([max(c)])``; that is why
    :mod:`megatron_hybrid.padding.equalize` needs a single MAX all-reduce.

    Raises:
        ValueError: no counts, a negative count, or ``align < 1``.

    >>> group_equalize([7104, 7168, 6912]), group_equalize([100, 30], align=64)
    (7168, 128)
    """
    where = "group_equalize"
    align = check_int("align", align, 1, where=where)
    counts = [
        check_int(f"per_rank_counts[{i}]", c, 0, where=where) for i, c in enumerate(per_rank_counts)
    ]
    if not counts:
        raise ValueError(f"{where}: per_rank_counts is empty; pass one count per rank")
    return round_up(max(counts), align)

"""Equal HybridEP token counts across the TP×EP group: one pre-pad to the group maximum.

HybridEP (before DeepEP's ragged dispatch) needs every rank of the TP×EP group to pass the same
number of tokens to dispatch (megatron-core 0.19.2 ``transformer/moe/token_dispatcher.py``). Instead
of megatron-core's per-MoE-layer MAX all-reduce (``moe_hybridep_pad_uneven_dispatch_inputs``, one
collective per layer, rounded to 64, which can interleave with optimizer collectives and hang,
NeMo-RL #2964 at EP = 32), each rank pads its micro-batch once, before the forward pass, to the
group maximum:

* BSHD: ``B`` is the same on every rank, so the padded row length ``S_pad`` is reduced; the
  maximum is already a multiple of ``divisible_by``, so every BSHD constraint still holds.
* THD: the packed total ``T`` is reduced; ``N = T / D`` is then equal everywhere and, as every
  ``T`` is a multiple of ``t``, still a multiple of the chunk (every THD constraint holds; the last
  sequence absorbs the extra tokens).

One all-reduce carries the count, the multiple, ``B`` (or ``D``) and the "fixed length" flag, in
both signs, so every rank sees the same maxima and minima and raises the same error on a mismatch
instead of some ranks hanging in the next collective.

"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_hybrid.padding.multiples import BshdPlan, Constraint, group_equalize
from megatron_hybrid.padding.thd import ThdPlan

__all__ = ["equalize_bshd", "equalize_thd", "extend_bshd", "extend_thd"]


def _check_extension(
    forced: bool, old: int, new: int, multiple: int, terms: Sequence[Constraint], what: str
) -> None:
    if isinstance(new, bool) or not isinstance(new, int):
        raise ValueError(f"{what} must be an integer, got {new!r}")
    if forced and new != old:
        raise ValueError(
            f"the plan has the fixed {what} {old} but the group needs {new}; every rank must "
            "use the same fixed length (seq_length / force_total)"
        )
    if new < old or new % multiple:
        reasons = "; ".join(c.reason for c in terms)
        raise ValueError(f"{what}={new} must be >= {old} and a multiple of {multiple} ({reasons})")


def extend_bshd(plan: BshdPlan, padded_len: int) -> BshdPlan:
    """Return ``plan`` padded further to ``padded_len`` (pure; used with the group maximum).

    Raises:
        ValueError: ``padded_len`` is shorter, not a multiple of ``plan.divisible_by``, or
            differs from a fixed length.
    """
    _check_extension(
        plan.forced, plan.padded_len, padded_len, plan.divisible_by, plan.constraints, "padded_len"
    )
    b = plan.batch_size
    return replace(
        plan,
        padded_len=padded_len,
        effective_seq_length=padded_len,
        per_rank_tokens=b * padded_len // plan.local_token_divisor,
        gemm_rows=b * padded_len // plan.cp,
    )


def extend_thd(plan: ThdPlan, total_tokens: int) -> ThdPlan:
    """Return ``plan`` with ``total_tokens`` tokens; the last sequence absorbs the extra (pure).

    Raises:
        ValueError: ``total_tokens`` is smaller, not a multiple of ``plan.total_multiple``, or
            differs from a fixed total.
    """
    _check_extension(
        plan.forced,
        plan.total_tokens,
        total_tokens,
        plan.total_multiple,
        plan.constraints,
        "total_tokens",
    )
    extra = total_tokens - plan.total_tokens
    padded = plan.padded_seqlens[:-1] + (plan.padded_seqlens[-1] + extra,)
    return replace(
        plan,
        padded_seqlens=padded,
        cu_seqlens_padded=plan.cu_seqlens_padded[:-1] + (total_tokens,),
        max_seqlen=max(padded),
        total_tokens=total_tokens,
        effective_seq_length=total_tokens,
        per_rank_tokens=total_tokens // plan.local_token_divisor,
        tokens_per_cp_rank=total_tokens // plan.cp,
    )


def _group_max_min(
    values: Sequence[int], group: dist.ProcessGroup, device: torch.device | str | None
) -> tuple[list[int], list[int]]:
    """One MAX all-reduce of ``values`` and their negations: returns (maxima, minima)."""
    if device is None:
        # NCCL only reduces CUDA tensors; gloo (CPU tests, demos) only CPU ones.
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    both = torch.tensor(list(values) + [-v for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    flat = both.tolist()
    n = len(values)
    return flat[:n], [-v for v in flat[n:]]


def _require_group(group: dist.ProcessGroup | None, where: str) -> None:
    if group is None:
        raise ValueError(
            f"{where}: pass the TP×EP process group explicitly (pg_collection.tp_ep); the counts "
            "must be equal exactly on the ranks that dispatch to each other"
        )


def _mismatch(where: str, what: str, maxima: Sequence[int], minima: Sequence[int]) -> None:
    raise ValueError(
        f"{where}: {what} differs across the group (min {minima}, max {maxima}); every rank of "
        "the TP×EP group must plan with the same parallel settings and micro-batch size"
    )


def _equalize(where, plan, group, device, local, extend, *, agreed: str, fixed: str):
    """The shared step: ``local = (count, multiple, shape, forced)``; ``extend(plan, count)``.

    ``multiple`` and ``shape`` must agree on every rank; the count is raised to the group
    maximum, which a fixed count on any rank must already equal.
    """
    _require_group(group, where)
    if dist.get_world_size(group) == 1:
        return plan
    maxima, minima = _group_max_min(local, group, device)
    if maxima[1:3] != minima[1:3]:
        _mismatch(where, agreed, maxima[1:3], minima[1:3])
    if maxima[3] and maxima[0] != minima[0]:
        _mismatch(where, fixed, maxima[:1], minima[:1])
    return extend(plan, group_equalize(maxima[:1], align=local[1]))


def equalize_bshd(
    plan: BshdPlan, group: dist.ProcessGroup, *, device: torch.device | str | None = None
) -> BshdPlan:
    """Pad ``plan`` to the longest padded row of the TP×EP ``group`` (one MAX all-reduce).

    Call it on every rank of ``group``, once per micro-batch, before the forward pass.

    Args:
        plan: this rank's plan from :func:`~megatron_hybrid.padding.bshd_pad`.
        group: the TP×EP process group (``pg_collection.tp_ep``).
        device: where the reduced tensor lives (default: CUDA for NCCL, else CPU).

    Returns:
        The plan extended to the group maximum; ``per_rank_tokens`` is equal on all ranks.

    Raises:
        ValueError: ``group`` is None, the ranks planned with different ``B`` or
            ``divisible_by``, or some rank has a fixed length another rank exceeds.
    """
    local = (plan.padded_len, plan.divisible_by, plan.batch_size, int(plan.forced))
    return _equalize(
        "equalize_bshd", plan, group, device, local, extend_bshd,
        agreed="(divisible_by, micro-batch size)", fixed="the fixed row length",
    )  # fmt: skip


def equalize_thd(
    plan: ThdPlan, group: dist.ProcessGroup, *, device: torch.device | str | None = None
) -> ThdPlan:
    """Pad ``plan`` to the largest packed total of the TP×EP ``group`` (one MAX all-reduce).

    Call it on every rank of ``group``, once per micro-batch, before the forward pass.

    Args:
        plan: this rank's plan from :func:`~megatron_hybrid.padding.thd_pack`.
        group: the TP×EP process group (``pg_collection.tp_ep``).
        device: where the reduced tensor lives (default: CUDA for NCCL, else CPU).

    Returns:
        The plan extended to the group maximum (the last sequence absorbs the extra tokens);
        ``per_rank_tokens`` is equal on all ranks.

    Raises:
        ValueError: ``group`` is None, the ranks planned with different ``total_multiple`` or
            ``D``, or some rank has a fixed total another rank exceeds.
    """
    local = (plan.total_tokens, plan.total_multiple, plan.local_token_divisor, int(plan.forced))
    return _equalize(
        "equalize_thd", plan, group, device, local, extend_thd,
        agreed="(total_multiple, D)", fixed="the fixed packed total",
    )  # fmt: skip

"""Derive the padding settings from a megatron ``TransformerConfig`` and process groups.

Pure Python: the config and the groups are only read through their attributes and ``size()``,
so this module imports neither torch nor megatron. Sizes come from the explicitly passed
``ProcessGroupCollection`` (never from ``parallel_state`` globals); a group that is None counts
as size 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_hybrid.checks import check_int
from megatron_hybrid.padding.multiples import (
    DEFAULT_HYBRIDEP_CHUNK,
    BshdPlan,
    bshd_pad,
    check_flag,
    hybridep_chunk,
    quant_align,
    seq_divisible_by,
)
from megatron_hybrid.padding.thd import ThdPlan, thd_pack

__all__ = ["PaddingConfig", "padding_config_from"]


@dataclass(frozen=True, kw_only=True)
class PaddingConfig:
    """The parallel and numeric settings padding depends on, with planner shortcuts.

    Attributes:
        tp: attention tensor-parallel size.
        cp: context-parallel size.
        sp: sequence parallelism (only True when ``tp > 1``, as megatron-core enforces).
        quant: quantisation recipe name for :func:`~megatron_hybrid.padding.quant_align`.
        hybridep: MoE tokens go through the flex dispatcher's HybridEP backend.
        chunk: HybridEP combine chunk (see :func:`~megatron_hybrid.padding.hybridep_chunk`).
        pp: pipeline-parallel size.
        ep: expert-parallel size.
        tp_ep: size of the TP×EP group HybridEP dispatches over.
        variable_seq_lengths: pipeline P2P shapes follow each micro-batch.
        strict_quant_per_rank: also align the per-rank GEMM rows (``quant_per_rank`` in
            ``docs/padding.md``).
    """

    tp: int = 1
    cp: int = 1
    sp: bool = False
    quant: str | None = None
    hybridep: bool = False
    chunk: int = DEFAULT_HYBRIDEP_CHUNK
    pp: int = 1
    ep: int = 1
    tp_ep: int = 1
    variable_seq_lengths: bool = False
    strict_quant_per_rank: bool = False

    def __post_init__(self) -> None:
        quant_align(self.quant)  # reject unknown recipes when the config is built
        for name in ("tp", "cp", "chunk", "pp", "ep", "tp_ep"):
            check_int(name, getattr(self, name), 1, where="PaddingConfig")
        for name in ("sp", "hybridep", "variable_seq_lengths", "strict_quant_per_rank"):
            check_flag(name, getattr(self, name), "PaddingConfig")
        if self.sp and self.tp == 1:
            raise ValueError(
                "PaddingConfig: sp=True needs tp > 1 (megatron-core turns sequence parallelism "
                "off at tp=1); pass sp=False"
            )

    @property
    def fixed_length_required(self) -> bool:
        """PP without ``variable_seq_lengths`` sizes its P2P buffers from ``seq_length``
        (megatron-core 0.19.2 ``pipeline_parallel/schedules.py``)."""
        return self.pp > 1 and not self.variable_seq_lengths

    @property
    def needs_group_equalize(self) -> bool:
        """HybridEP needs equal per-rank counts when its group has more than one rank (§6)."""
        return self.hybridep and self.tp_ep > 1

    def _common(self) -> dict[str, Any]:
        return dict(
            tp=self.tp,
            cp=self.cp,
            sp=self.sp,
            quant=self.quant,
            hybridep=self.hybridep,
            chunk=self.chunk,
        )

    def divisible_by(self, batch_size: int) -> int:
        """:func:`~megatron_hybrid.padding.seq_divisible_by` for these settings."""
        return seq_divisible_by(
            batch_size=batch_size,
            strict_quant_per_rank=self.strict_quant_per_rank,
            **self._common(),
        )

    def bshd(
        self,
        *,
        cur_len: int,
        batch_size: int,
        force_len: int | None = None,
        force_policy: str = "raise",
    ) -> BshdPlan:
        """:func:`~megatron_hybrid.padding.bshd_pad` for these settings."""
        return bshd_pad(
            cur_len=cur_len,
            batch_size=batch_size,
            strict_quant_per_rank=self.strict_quant_per_rank,
            force_len=force_len,
            force_policy=force_policy,
            **self._common(),
        )

    def thd(
        self,
        seqlens: Sequence[int],
        *,
        mode: str = "minimal",
        force_total: int | None = None,
        force_policy: str = "raise",
    ) -> ThdPlan:
        """:func:`~megatron_hybrid.padding.thd_pack` for these settings."""
        return thd_pack(
            seqlens,
            mode=mode,
            force_total=force_total,
            force_policy=force_policy,
            **self._common(),
        )

    def align_seq_length(
        self,
        seq_length: int,
        *,
        micro_batch_size: int,
        force_policy: str = "raise",
        max_position_embeddings: int | None = None,
    ) -> int:
        """Check (or round up) a fixed ``seq_length`` once, at setup time.

        Write the result back to the training config before pipeline shapes are computed; never
        call this per batch.

        Raises:
            ValueError: ``seq_length`` is unaligned under ``"raise"``, or rounding it up exceeds
                ``max_position_embeddings``.

        >>> PaddingConfig(hybridep=True).align_seq_length(
        ...     1776, micro_batch_size=4, force_policy="round_up")
        1792
        """
        plan = self.bshd(
            cur_len=seq_length,
            batch_size=micro_batch_size,
            force_len=seq_length,
            force_policy=force_policy,
        )
        aligned = plan.effective_seq_length
        if max_position_embeddings is not None and aligned > max_position_embeddings:
            fits = max_position_embeddings // plan.divisible_by * plan.divisible_by
            fix = (
                f"lower seq_length to {fits} or raise max_position_embeddings"
                if fits
                else f"no aligned length fits; raise max_position_embeddings to at least "
                f"{plan.divisible_by}"
            )
            raise ValueError(
                f"seq_length {seq_length} rounds up to {aligned} (multiple of "
                f"{plan.divisible_by}: {plan.breakdown}), beyond max_position_embeddings="
                f"{max_position_embeddings}; {fix}"
            )
        return aligned


def _size(pg_collection: Any, name: str) -> int:
    group = getattr(pg_collection, name, None)
    return 1 if group is None else int(group.size())


def _quant_of(config: Any) -> str | None:
    """The recipe whose multiple applies, in megatron-core's order (``moe_utils.py``)."""
    if getattr(config, "fp8", None):
        recipe = getattr(config, "fp8_recipe", None) or "delayed"
        return str(getattr(recipe, "value", recipe))
    if getattr(config, "fp4", None):
        # fp4_utils.get_fp4_align_size returns 128 for every FP4 recipe (custom included).
        return "nvfp4"
    return None


def padding_config_from(
    config: Any,
    pg_collection: Any,
    *,
    chunk: int | None = None,
    strict_quant_per_rank: bool = False,
    environ: Mapping[str, str] | None = None,
) -> PaddingConfig:
    """Read the padding settings from a ``TransformerConfig`` and a ``ProcessGroupCollection``.

    Args:
        config: a megatron ``TransformerConfig`` (any object with its attribute names works).
        pg_collection: a ``ProcessGroupCollection``; ``tp``, ``cp``, ``pp``, ``ep`` and ``tp_ep``
            are read with ``.size()``, and a missing (None) group counts as size 1.
        chunk: HybridEP combine chunk override; the environment variable
            ``NUM_OF_TOKENS_PER_CHUNK_COMBINE_API`` is honoured on top.
        strict_quant_per_rank: see :func:`~megatron_hybrid.padding.seq_divisible_by`.
        environ: environment to read instead of ``os.environ``.

    Raises:
        ValueError: ``pg_collection`` is None, or the recipe or chunk is invalid.
    """
    if pg_collection is None:
        raise ValueError(
            "padding_config_from: pass the model's ProcessGroupCollection; sizes are never read "
            "from parallel_state globals"
        )
    tp, cp, ep = (_size(pg_collection, name) for name in ("tp", "cp", "ep"))
    # HybridEP is the flex dispatcher's "hybridep" backend (MoE models only).
    hybridep = (
        bool(getattr(config, "num_moe_experts", None))
        and getattr(config, "moe_token_dispatcher_type", None) == "flex"
        and getattr(config, "moe_flex_dispatcher_backend", None) == "hybridep"
    )
    return PaddingConfig(
        tp=tp,
        cp=cp,
        # megatron-core switches SP off when tp == 1 (training/arguments.py).
        sp=bool(getattr(config, "sequence_parallel", False)) and tp > 1,
        quant=_quant_of(config),
        hybridep=hybridep,
        chunk=hybridep_chunk(chunk, environ=environ),
        pp=_size(pg_collection, "pp"),
        ep=ep,
        # tp_ep = expert-TP x EP; fall back to its factors when the group was not built.
        tp_ep=(
            _size(pg_collection, "tp_ep")
            if getattr(pg_collection, "tp_ep", None) is not None
            else _size(pg_collection, "expt_tp") * ep
        ),
        variable_seq_lengths=bool(getattr(config, "variable_seq_lengths", False)),
        strict_quant_per_rank=strict_quant_per_rank,
    )

"""``LoRAConfig``: what to adapt, with which rank and scale.

Targets name Megatron modules (the attribute a layer keeps its linear under), Hugging Face
module names (the pieces a fused Megatron weight is cut into, e.g. ``q_proj`` of
``linear_qkv``), routed-expert parameters as PEFT names them (``experts.gate_up_proj``) or
module paths with shell wildcards. They are resolved against a model in
:mod:`megatron_hybrid.peft.targets`; a name that matches nothing there is an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from megatron_hybrid.checks import check_int

__all__ = ["ALL_LINEAR", "MEGATRON_TARGETS", "LoRAConfig", "LoRAConfigError"]

#: The target that stands for every linear of every layer type and every routed expert.
ALL_LINEAR = "all-linear"

#: Megatron target name -> what it is. Routers, the shared-expert gate, embeddings, the output
#: layer and MTP's ``eh_proj`` are not targets.
MEGATRON_TARGETS: dict[str, str] = {
    "linear_qkv": "attention query/key/value projection (`*`)",
    "linear_proj": "attention and MLA output projection (`*`, `+`, `D`)",
    "in_proj": "GatedDeltaNet and Mamba input projection (`G`, `M`)",
    "out_proj": "GatedDeltaNet and Mamba output projection (`G`, `M`)",
    "linear_q_proj": "MLA query projection without q_lora_rank (`+`, `D`)",
    "linear_q_down_proj": "MLA query down-projection (`+`, `D`)",
    "linear_q_up_proj": "MLA query up-projection (`+`, `D`)",
    "linear_kv_down_proj": "MLA key/value down-projection (`+`, `D`)",
    "linear_kv_up_proj": "MLA key/value up-projection (`+`, `D`)",
    "linear_fc1": "MLP input projection: dense (`-`), shared and routed experts (`E`)",
    "linear_fc2": "MLP output projection: dense (`-`), shared and routed experts (`E`)",
}


class LoRAConfigError(ValueError):
    """A LoRA configuration or target list that cannot be applied; the message says why."""


def _names(value, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise LoRAConfigError(
            f"LoRAConfig.{what} must be a string or a list of strings, got {value!r}"
        )
    out = []
    for name in value:
        if not name or name != name.strip() or any(c.isspace() for c in name):
            raise LoRAConfigError(
                f"LoRAConfig.{what}: {name!r} is not a target name (no spaces, not empty)"
            )
        if name not in out:
            out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters ``W x + scale * B A x`` with ``scale = alpha / rank`` (``alpha /
    sqrt(rank)`` with ``use_rslora``), ``B = 0`` at the start.

    Attributes:
        rank: the adapter rank ``r``.
        alpha: the scale numerator.
        dropout: dropout on the adapter's input while training (PEFT's ``lora_dropout``;
            exports always say 0, which is what inference uses).
        targets: ``"all-linear"`` or names: Megatron targets (:data:`MEGATRON_TARGETS`),
            Hugging Face module names of a model loaded from Hugging Face (``q_proj``,
            ``in_proj_qkv``, ``gate_proj``, ...: a piece of a fused Megatron weight),
            ``experts.<param>`` for routed experts as PEFT names them
            (``experts.gate_up_proj``, ``experts.down_proj``), or module paths, whole or as a
            dotted suffix, with shell wildcards (``decoder.layers.0.*``,
            ``shared_experts.linear_fc1``).
        exclude: names in the same forms; what they match gets no adapter.
        shared_a: one ``A`` per fused Megatron weight instead of one per Hugging Face piece
            (Megatron-Bridge's "performant" LoRA: one GEMM less per piece; exported by
            copying ``A`` to every piece).
        use_rslora: rank-stabilised scale ``alpha / sqrt(rank)`` (PEFT's ``use_rslora``).
        init_seed: seed of ``A``'s initialisation; the values depend only on it and the
            weight's checkpoint key, not on the parallel layout.
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: str | Sequence[str] = ALL_LINEAR
    exclude: Sequence[str] = field(default=())
    shared_a: bool = False
    use_rslora: bool = False
    init_seed: int = 0

    def __post_init__(self) -> None:
        try:
            check_int("rank", self.rank, where="LoRAConfig")
            check_int("init_seed", self.init_seed, 0, where="LoRAConfig")
        except ValueError as error:
            raise LoRAConfigError(str(error)) from None
        alpha = self.alpha
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, int | float)
            or not math.isfinite(alpha)
            or alpha <= 0
        ):
            raise LoRAConfigError(f"LoRAConfig: alpha must be a finite number > 0, got {alpha!r}")
        dropout = self.dropout
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, int | float)
            or not 0 <= dropout < 1
        ):
            raise LoRAConfigError(f"LoRAConfig: dropout must be in [0, 1), got {dropout!r}")
        targets = _names(self.targets, "targets")
        if not targets:
            raise LoRAConfigError(
                "LoRAConfig.targets is empty: name what to adapt, or 'all-linear'"
            )
        if ALL_LINEAR in targets and len(targets) > 1:
            raise LoRAConfigError(
                f"LoRAConfig.targets: {ALL_LINEAR!r} already covers every linear; use exclude "
                f"to leave some out instead of listing more ({list(targets)})"
            )
        exclude = _names(self.exclude, "exclude")
        if ALL_LINEAR in exclude:
            raise LoRAConfigError(f"LoRAConfig.exclude cannot be {ALL_LINEAR!r}")
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "alpha", float(alpha))
        object.__setattr__(self, "dropout", float(dropout))
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "exclude", exclude)

    @property
    def scale(self) -> float:
        """The factor of ``B A``."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def all_linear(self) -> bool:
        """Whether the targets are ``"all-linear"``."""
        return self.targets == (ALL_LINEAR,)

    def to_dict(self) -> dict:
        """A JSON-ready dict (recorded in adapter checkpoints)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["targets"] = list(self.targets)
        out["exclude"] = list(self.exclude)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> LoRAConfig:
        """The config :meth:`to_dict` wrote."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LoRAConfigError(f"unknown LoRAConfig fields {unknown} (known: {sorted(known)})")
        return cls(**data)

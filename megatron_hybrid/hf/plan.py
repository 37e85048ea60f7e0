"""The conversion plan: which rows of which Hugging Face tensor become which rows of which
megatron checkpoint tensor.

Every transform the supported families need is a reordering of rows (dim 0): a fused
``[gate; up]`` projection is two row ranges, GatedDeltaNet's ``in_proj`` pieces are row ranges
of ``in_proj_qkv``, the attention ``linear_qkv`` with an output gate is a per-group interleave of
``q_proj``/``k_proj``/``v_proj`` rows, Qwen3-Next's head-grouped ``in_proj_qkvz`` likewise. So a
plan is a list of :class:`Link` (``key`` rows ``<-`` ``hf_name`` rows) that covers each side's
rows exactly once, and the two directions are the same table read both ways.

The megatron side is the *checkpoint key* space (the keys and global shapes a ``torch_dist``
checkpoint of the model holds, ``docs/checkpoints.md``): it does not depend on the TP/EP/PP
layout, and megatron's own ``sharded_state_dict`` says which box of each global tensor a rank
holds, fused TP layouts included. Expert tensors carry a leading expert axis
(``...mlp.experts.experts.linear_fc1.weight`` is ``[E, 2I, H]``); a link names the expert.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from megatron_hybrid.hf.config import HFConversion, family_named

__all__ = [
    "FusedExperts",
    "Link",
    "Plan",
    "PlanBuilder",
    "PlanReport",
    "RowIndex",
    "build_plan",
    "check_plan",
]

#: Rows of a tensor: a step-1 ``slice`` or an explicit tuple of row indices.
RowIndex = slice | tuple[int, ...]


def _length(rows: RowIndex, size: int) -> int:
    if isinstance(rows, slice):
        return len(range(*rows.indices(size)))
    return len(rows)


@dataclass(frozen=True)
class Link:
    """Rows ``key_rows`` of checkpoint tensor ``key`` (expert ``expert``) are rows ``hf_rows`` of
    Hugging Face tensor ``hf_name``, in that order."""

    key: str
    key_rows: slice
    hf_name: str
    hf_rows: RowIndex
    expert: int | None = None


@dataclass(frozen=True)
class FusedExperts:
    """transformers' in-memory 3-D parameter that holds one expert tensor per expert on disk.

    transformers 5 keeps routed experts as ``<module>.<param>`` of shape ``[E, out, in]``
    (``gate_up_proj`` = ``[gate; up]`` rows, ``down_proj``; Nemotron-H ``up_proj``), written per
    expert by ``save_pretrained``; adapters address the in-memory parameter (PEFT's
    ``target_parameters``).

    Attributes:
        key: the checkpoint key (expert axis first) the parameter holds.
        module: on-disk name of the experts module (``model.layers.0.mlp.experts``).
        param: the parameter's name in that module.
        order: its position among the module's parameters (registration order).
    """

    key: str
    module: str
    param: str
    order: int


@dataclass
class PlanReport:
    """What a dry run found; empty lists mean the conversion is exact and complete.

    Attributes:
        unmapped_model: model checkpoint tensors no Hugging Face tensor feeds.
        unused_hf: Hugging Face tensors the model does not use.
        missing_hf: Hugging Face tensors the plan needs but the folder lacks.
        shape_errors: ``(name, message)`` for tensors whose shapes do not fit.
        unsupported_config: ``(field, message)`` for config fields that cannot be mapped.
        shared_copies: Hugging Face tensors that duplicate another one (checked, not loaded).
        carried: Hugging Face tensors of declared parts the model does not compute (a vision
            tower), carried through untouched.
        notes: what the conversion does besides mapping (FP8 dequantized, parts carried).
    """

    unmapped_model: list[str] = field(default_factory=list)
    unused_hf: list[str] = field(default_factory=list)
    missing_hf: list[str] = field(default_factory=list)
    shape_errors: list[tuple[str, str]] = field(default_factory=list)
    unsupported_config: list[tuple[str, str]] = field(default_factory=list)
    shared_copies: dict[str, str] = field(default_factory=dict)
    carried: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every tensor and config field maps."""
        return not (
            self.unmapped_model
            or self.unused_hf
            or self.missing_hf
            or self.shape_errors
            or self.unsupported_config
        )

    def lines(self, limit: int = 20) -> list[str]:
        """The report as text lines (at most ``limit`` entries per list), notes first."""
        out = list(self.notes)
        sections = (
            ("unsupported config fields", [f"{k}: {m}" for k, m in self.unsupported_config]),
            ("Hugging Face tensors missing", self.missing_hf),
            ("Hugging Face tensors not used by the model", self.unused_hf),
            ("model tensors with no Hugging Face source", self.unmapped_model),
            ("shape mismatches", [f"{k}: {m}" for k, m in self.shape_errors]),
        )
        for title, entries in sections:
            if entries:
                out.append(f"{title} ({len(entries)}):")
                out += [f"  {e}" for e in entries[:limit]]
                if len(entries) > limit:
                    out.append(f"  ... and {len(entries) - limit} more")
        return out


@dataclass
class Plan:
    """A resolved plan: links plus the global shapes of both sides.

    Attributes:
        links: every link.
        key_shapes: checkpoint key -> global shape (expert axis first for expert tensors).
        hf_shapes: Hugging Face name -> shape, in the order tensors are written.
        shared_copies: Hugging Face name -> the name whose copy it is (written on export,
            compared on import instead of loaded).
        keep_fp32: Hugging Face names exported in float32 whatever the target dtype.
        fused_experts: expert checkpoint key -> the in-memory 3-D parameter it is.
    """

    links: list[Link]
    key_shapes: dict[str, tuple[int, ...]]
    hf_shapes: dict[str, tuple[int, ...]]
    shared_copies: dict[str, str] = field(default_factory=dict)
    keep_fp32: frozenset[str] = frozenset()
    fused_experts: dict[str, FusedExperts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_key: dict[tuple[str, int | None], list[Link]] = {}
        self.by_hf: dict[str, list[Link]] = {}
        for link in self.links:
            self.by_key.setdefault((link.key, link.expert), []).append(link)
            self.by_hf.setdefault(link.hf_name, []).append(link)

    def hf_names(self) -> list[str]:
        """Hugging Face tensor names in export order (shared copies included)."""
        return list(self.hf_shapes)


class PlanBuilder:
    """Collects links while a family's table is walked, resolving the backend's key variants.

    Args:
        key_shapes: the model's checkpoint keys with global shapes.
    """

    def __init__(self, key_shapes: dict[str, tuple[int, ...]]) -> None:
        self.key_shapes = key_shapes
        self.links: list[Link] = []
        self.hf_shapes: dict[str, tuple[int, ...]] = {}
        self.shared_copies: dict[str, str] = {}
        self.keep_fp32: set[str] = set()
        self.fused_experts: dict[str, FusedExperts] = {}
        self.unresolved: list[str] = []

    def key(self, prefix: str, *suffixes: str) -> str | None:
        """The first of ``prefix + suffix`` the model has (backends name some tensors
        differently: the local spec stores ``input_layernorm`` as
        ``self_attention.linear_qkv.layer_norm_weight``, TE fuses norms into linears)."""
        for suffix in suffixes:
            if prefix + suffix in self.key_shapes:
                return prefix + suffix
        self.unresolved.append(prefix + " | ".join(suffixes))
        return None

    def _rows(self, key: str, expert: int | None) -> int:
        shape = self.key_shapes[key]
        return shape[1] if expert is not None else shape[0]

    def hf(self, name: str, shape: Sequence[int]) -> None:
        """Declare a Hugging Face tensor and its shape (export order = declaration order)."""
        shape = tuple(int(s) for s in shape)
        if self.hf_shapes.setdefault(name, shape) != shape:
            raise AssertionError(f"{name} declared with shapes {self.hf_shapes[name]} and {shape}")

    def copy(self, key: str | None, name: str, expert: int | None = None) -> None:
        """``key`` (expert ``expert``) is ``name``, whole."""
        if key is None:
            return
        shape = self.key_shapes[key][1:] if expert is not None else self.key_shapes[key]
        self.hf(name, shape)
        self.links.append(Link(key, slice(0, shape[0]), name, slice(0, shape[0]), expert))

    def concat(
        self, key: str | None, parts: Iterable[tuple[str, int]], expert: int | None = None
    ) -> None:
        """``key`` rows are the rows of ``parts`` (``(name, rows)``) one after another."""
        if key is None:
            return
        tail = self.key_shapes[key][2:] if expert is not None else self.key_shapes[key][1:]
        start = 0
        for name, rows in parts:
            self.hf(name, (rows, *tail))
            self.links.append(Link(key, slice(start, start + rows), name, slice(0, rows), expert))
            start += rows

    def split(self, name: str, parts: Iterable[tuple[str | None, int]]) -> None:
        """``name`` rows are the keys of ``parts`` (``(key, rows)``) one after another."""
        parts = list(parts)
        tail = None
        start = 0
        for key, rows in parts:
            if key is not None:
                tail = self.key_shapes[key][1:]
                self.links.append(Link(key, slice(0, rows), name, slice(start, start + rows)))
            start += rows
        if tail is not None:
            self.hf(name, (start, *tail))

    def gather(self, key: str | None, name: str, rows: Sequence[int], key_start: int = 0) -> None:
        """Rows ``key_start:`` of ``key`` are rows ``rows`` of ``name`` (an interleave)."""
        if key is None:
            return
        rows = tuple(int(r) for r in rows)
        self.links.append(Link(key, slice(key_start, key_start + len(rows)), name, rows))

    def shared(self, name: str, original: str) -> None:
        """``name`` is a stored copy of ``original`` (DeepSeek's MTP embedding and head)."""
        self.shared_copies[name] = original
        self.hf_shapes[name] = self.hf_shapes[original]

    def fp32(self, name: str) -> None:
        """Export ``name`` in float32 (router biases that HF keeps in fp32)."""
        self.keep_fp32.add(name)

    def experts(self, key: str | None, module: str, param: str, order: int) -> None:
        """Expert tensor ``key`` is transformers' in-memory ``module.param`` (see
        :class:`FusedExperts`)."""
        if key is not None:
            self.fused_experts[key] = FusedExperts(key, module, param, order)

    def build(self) -> Plan:
        """The resolved :class:`Plan`."""
        return Plan(
            links=self.links,
            key_shapes=dict(self.key_shapes),
            hf_shapes=dict(self.hf_shapes),
            shared_copies=dict(self.shared_copies),
            keep_fp32=frozenset(self.keep_fp32),
            fused_experts=dict(self.fused_experts),
        )


def build_plan(conversion: HFConversion, key_shapes: dict, family=None) -> tuple[Plan, list[str]]:
    """The conversion plan for a model with checkpoint tensors ``key_shapes``.

    Returns:
        ``(plan, unresolved)``: unresolved are key variants no model tensor matched.
    """
    builder = PlanBuilder(key_shapes)
    (family or family_named(conversion.family)).plan(builder, conversion)
    return builder.build(), builder.unresolved


def check_plan(plan: Plan, unresolved: Sequence[str], hf_info: dict | None) -> PlanReport:
    """Check that a plan covers both sides exactly once and fits the Hugging Face shapes.

    Args:
        plan: the plan.
        unresolved: key variants no model key matched.
        hf_info: Hugging Face name -> (dtype, shape) of a source folder, or None (export).
    """
    report = PlanReport(shared_copies=dict(plan.shared_copies))
    report.unmapped_model += [f"(no model tensor) {u}" for u in unresolved]
    covered: dict[tuple[str, int | None], int] = {}
    for (key, expert), links in plan.by_key.items():
        covered[(key, expert)] = sum(link.key_rows.stop - link.key_rows.start for link in links)
    for key, shape in plan.key_shapes.items():
        experts = [None] if not _is_expert_key(key) else range(shape[0])
        rows = shape[1] if _is_expert_key(key) else shape[0]
        for expert in experts:
            got = covered.get((key, expert), 0)
            if got == 0:
                label = key if expert is None else f"{key} [expert {expert}]"
                report.unmapped_model.append(label)
            elif got != rows:
                report.shape_errors.append((key, f"{got} of {rows} rows mapped"))
    if hf_info is not None:
        for name, shape in plan.hf_shapes.items():
            if name not in hf_info:
                report.missing_hf.append(name)
            elif tuple(hf_info[name][1]) != shape:
                report.shape_errors.append(
                    (name, f"checkpoint has {tuple(hf_info[name][1])}, the model needs {shape}")
                )
        report.unused_hf += [name for name in hf_info if name not in plan.hf_shapes]
    for name, links in plan.by_hf.items():
        rows = sum(_length(link.hf_rows, plan.hf_shapes[name][0]) for link in links)
        if name in plan.hf_shapes and rows != plan.hf_shapes[name][0]:
            report.shape_errors.append((name, f"{rows} of {plan.hf_shapes[name][0]} rows mapped"))
    return report


#: Checkpoint keys with a leading expert axis (megatron's SequentialMLP sharded form).
EXPERT_KEY_MARK = ".mlp.experts.experts."


def _is_expert_key(key: str) -> bool:
    return EXPERT_KEY_MARK in key

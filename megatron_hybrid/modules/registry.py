"""Runtime part of the layer-type table, and the one call that registers a layer type.

A layer type is two records with the same symbol: its pure facts
(:class:`~megatron_hybrid.pattern.LayerTypeFacts`: name, slot, GPT role, THD rule, colour; read
by the parser and ``describe`` without torch) and its :class:`LayerRuntime` (where its spec lives,
how to build and call a layer, what it runs in the EP-overlap schedule and which delayed weight
gradients it owns). The built-in types have one module each under
:mod:`megatron_hybrid.modules.layer_types`. Generic code — the stack, recompute, the schedule
plan — looks a symbol up here and never branches on it, so a new layer type is one
:func:`register_layer_type` call (``tests/unit/test_new_layer_type.py`` defines one).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from torch import Tensor, nn

from megatron_hybrid.pattern import (
    LayerTypeFacts,
    Slot,
    layer_facts,
    layer_symbols,
    register_layer_facts,
    unregister_layer_facts,
)

__all__ = [
    "LAYER_RUNTIMES",
    "LayerBuildArgs",
    "LayerInputs",
    "GraphPiece",
    "LayerRuntime",
    "ScheduleRole",
    "TerminalSlots",
    "layer_runtime",
    "register_layer_type",
    "unregister_layer_type",
]


@dataclass(frozen=True)
class LayerBuildArgs:
    """What every layer builder receives.

    Attributes:
        config: the model's TransformerConfig.
        pg_collection: process groups of the model.
        layer_number: global, 1-based, physical layer number.
        stage_offset: physical layer offset of this pipeline stage (megatron's
            ``pp_layer_offset``: ``layer_number - stage_offset`` is the layer's index in the
            stage, which inference caches use).
        is_mtp_layer: whether the layer belongs to an MTP depth.
        name: module instance name (``decoder.layers.3.layers.1``), or None.
    """

    config: Any
    pg_collection: Any
    layer_number: int
    stage_offset: int
    is_mtp_layer: bool = False
    name: str | None = None


@dataclass
class LayerInputs:
    """Per-forward inputs shared by all layers of a stack (the TransformerBlock arguments)."""

    attention_mask: Tensor | None = None
    inference_context: Any = None
    rotary_pos_emb: Any = None
    rotary_pos_cos: Tensor | None = None
    rotary_pos_sin: Tensor | None = None
    rotary_pos_cos_sin: Tensor | None = None
    sequence_len_offset: Tensor | None = None
    packed_seq_params: Any = None
    padding_mask: Tensor | None = None


class ScheduleRole(StrEnum):
    """What a layer does in the combined-1F1B schedule (``docs/ep_overlap.md``).

    ``PRE_LAYER``: runs whole in the pre-dispatch slot (mixers and attention-slot types);
    ``DENSE_MLP``: a terminal whose MLP runs in the ``mlp`` slot; ``MOE``: a terminal whose
    router runs in the pre-dispatch slot, its experts between dispatch and combine.
    """

    PRE_LAYER = "pre_layer"
    DENSE_MLP = "dense_mlp"
    MOE = "moe"


class TerminalSlots(NamedTuple):
    """What the MLP-slot member of a logical layer runs in the schedule's slots.

    Each is ``(node, *inputs) -> outputs`` as megatron-core's ``TransformerLayerNode`` calls it,
    or None where the terminal has nothing to do (the schedule then passes hidden states on).
    The schedule adds the pre-layers before ``pre_dispatch_tail`` and the decoder's final norm
    after the last slot.

    Attributes:
        pre_dispatch_tail: after the pre-layers, in the pre-dispatch slot (an MoE's router).
        dispatch: the communication slot before the experts.
        mlp: the ``mlp`` compute slot.
        combine: the communication slot after the experts.
        num_local_experts: for an MoE terminal, its experts on this rank (the schedule's nodes
            need it).
    """

    pre_dispatch_tail: Callable | None = None
    dispatch: Callable | None = None
    mlp: Callable | None = None
    combine: Callable | None = None
    num_local_experts: int | None = None


class GraphPiece(NamedTuple):
    """A submodule of a layer that CUDA graphs may capture, or why it must run eager.

    ``megatron_hybrid.schedule.graphs`` replaces the forward of every piece without a reason by
    one that replays a captured graph (per input shape), in the plain schedule and in the
    EP-overlap plan alike, since both call the same submodules.

    Attributes:
        module: the submodule; its forward must take tensors (and None or plain scalars) and
            return tensors, and must not synchronise with the host.
        reason: None if it can be captured, else why it runs eager (a host sync, a dynamic
            shape, communication, an unsupported setting).
        packed: its forward reads packed (THD) boundaries on the device only, given them of a
            fixed size (:class:`~megatron_hybrid.padding.fixed.FixedPackedSeqParams`), so packed
            micro-batches replay its graphs; otherwise they run it eager.
    """

    module: nn.Module
    reason: str | None = None
    packed: bool = False


#: ``layer -> {piece name: GraphPiece}``: what of a layer CUDA graphs may capture.
GraphPieces = Callable[[nn.Module], dict[str, GraphPiece]]

#: ``(layer, hidden_states, node) -> hidden_states``: a pre-layer in the pre-dispatch slot.
PreDispatchRunner = Callable[[nn.Module, Tensor, Any], Tensor]
#: ``layer -> {slot name: [objects with backward_dw() and parameters()]}``.
BackwardDW = Callable[[nn.Module], dict[str, list]]


@dataclass(frozen=True, kw_only=True)
class LayerRuntime:
    """How one layer type is specified, built, called and scheduled.

    Attributes:
        symbol: the pattern symbol (its facts must be registered under the same symbol).
        spec_field: the :class:`~megatron_hybrid.modules.specs.HybridStackSubmodules` field
            holding the spec, or for a registered type the key in its ``extra_layers``.
        build: ``(spec, LayerBuildArgs) -> nn.Module``.
        forward: ``(layer, hidden_states, LayerInputs) -> hidden_states``.
        schedule_role: what the layer runs in the EP-overlap schedule.
        run_pre_dispatch: for ``PRE_LAYER`` types, the layer in the pre-dispatch slot (None: the
            type cannot run before the MLP of an overlapped logical layer).
        terminal_slots: for ``DENSE_MLP`` and ``MOE`` types, ``layer -> TerminalSlots``.
        backward_dw: the layer's delayed weight-gradient callables per schedule slot.
        default_spec: ``backend name -> ModuleSpec`` for the backends that do not build the type
            themselves (every registered type needs it; built-ins come from the backends).
        graph_pieces: the submodules CUDA graphs may capture and those that stay eager, with
            the reason (``docs/ep_overlap.md``, "CUDA graphs"); a type without it is not graphed.
        flops: ``(config, SequenceBatch) -> {part: FLOPs}``, the forward matrix-product FLOPs of
            one layer of this type (:mod:`megatron_hybrid.modules.flops`; None: MFU cannot be
            computed for a pattern with this type).
    """

    symbol: str
    spec_field: str
    build: Callable[[Any, LayerBuildArgs], nn.Module]
    forward: Callable[[nn.Module, Tensor, LayerInputs], Tensor]
    schedule_role: ScheduleRole = ScheduleRole.PRE_LAYER
    run_pre_dispatch: PreDispatchRunner | None = None
    terminal_slots: Callable[[nn.Module], TerminalSlots] | None = None
    backward_dw: BackwardDW = field(default=lambda layer: {})
    default_spec: Callable[[str], Any] | None = None
    graph_pieces: GraphPieces = field(default=lambda layer: {})
    flops: Callable[[Any, Any], dict[str, float]] | None = None

    def check(self, facts: LayerTypeFacts) -> None:
        """Raise ``ValueError`` if this runtime does not fit ``facts``."""
        symbol = facts.symbol
        if self.symbol != symbol:
            raise ValueError(f"runtime symbol {self.symbol!r} differs from facts {symbol!r}")
        terminal = self.schedule_role != ScheduleRole.PRE_LAYER
        if terminal != (facts.slot == Slot.MLP):
            raise ValueError(
                f"{facts.name} ({symbol!r}) takes the {facts.slot.value} slot, so its "
                f"schedule_role must be {'DENSE_MLP or MOE' if not terminal else 'PRE_LAYER'}, "
                f"not {self.schedule_role.name}"
            )
        if terminal and not callable(self.terminal_slots):
            raise ValueError(f"{facts.name} ({symbol!r}) is an MLP-slot type: give terminal_slots")
        for name in ("build", "forward", "backward_dw", "graph_pieces"):
            if not callable(getattr(self, name)):
                raise ValueError(f"{name} of layer type {symbol!r} must be callable")
        if self.flops is not None and not callable(self.flops):
            raise ValueError(f"flops of layer type {symbol!r} must be callable or None")
        if not self.spec_field.isidentifier():
            raise ValueError(
                f"spec_field of {symbol!r} must be an identifier, got {self.spec_field!r}"
            )


class _LiveTable(Mapping[str, LayerRuntime]):
    """Symbol -> LayerRuntime, read-only and live (registrations show at once)."""

    def __getitem__(self, symbol: str) -> LayerRuntime:
        return _runtimes[symbol]

    def __iter__(self) -> Iterator[str]:
        return iter(_runtimes)

    def __len__(self) -> int:
        return len(_runtimes)


# The built-in types are registered by megatron_hybrid.modules.layer_types, which the modules
# package imports: registration runs from the types to this module, never back.
_runtimes: dict[str, LayerRuntime] = {}

#: Symbol -> LayerRuntime of every layer type (read-only, live).
LAYER_RUNTIMES: Mapping[str, LayerRuntime] = _LiveTable()


def register_builtin_runtime(runtime: LayerRuntime) -> None:
    """Add a built-in type's runtime (its facts are in the pattern package's table)."""
    runtime.check(layer_facts(runtime.symbol))
    assert runtime.symbol not in _runtimes, runtime.symbol
    _runtimes[runtime.symbol] = runtime


def _replace_runtime(runtime: LayerRuntime) -> None:
    """Swap the runtime of an existing type (the deprecated hooks that patch one piece)."""
    runtime.check(layer_facts(runtime.symbol))
    _runtimes[runtime.symbol] = runtime


def layer_runtime(symbol: str) -> LayerRuntime:
    """The runtime of ``symbol``.

    Raises:
        ValueError: no layer type has that symbol, or it has facts but no runtime.
    """
    runtimes = _runtimes
    if symbol not in runtimes:
        facts = layer_facts(symbol)  # raises for an unknown symbol
        raise ValueError(
            f"{facts.name} ({symbol!r}) has facts but no runtime; register both with "
            "megatron_hybrid.modules.register_layer_type(facts, runtime)"
        )
    return runtimes[symbol]


def register_layer_type(facts: LayerTypeFacts, runtime: LayerRuntime) -> None:
    """Add a layer type: its symbol parses, describes, builds, checkpoints and schedules.

    Args:
        facts: the pure facts (symbol, name, slot, GPT role, THD rule, colour).
        runtime: spec field, build and forward, schedule role and pieces, delayed wgrad, and
            ``default_spec`` for the backends.

    Raises:
        ValueError: the symbol is taken, or a field of either record is invalid.
    """
    runtimes = _runtimes
    facts.check()
    if facts.symbol in layer_symbols():
        raise ValueError(
            f"the layer symbol {facts.symbol!r} is already taken by "
            f"{layer_facts(facts.symbol).name}; pick another character"
        )
    runtime.check(facts)
    if runtime.default_spec is None:
        raise ValueError(
            f"layer type {facts.symbol!r} needs runtime.default_spec (backend -> ModuleSpec): "
            "the spec backends only build the built-in types"
        )
    taken = {r.spec_field for r in runtimes.values()}
    if runtime.spec_field in taken:
        raise ValueError(f"spec_field {runtime.spec_field!r} is already used by another type")
    register_layer_facts(facts)
    runtimes[facts.symbol] = runtime


def unregister_layer_type(symbol: str) -> None:
    """Remove a registered layer type (built-in types stay).

    Raises:
        ValueError: ``symbol`` is built in or not registered.
    """
    unregister_layer_facts(symbol)
    _runtimes.pop(symbol, None)


def registered_symbols() -> tuple[str, ...]:
    """Symbols with both facts and runtime, in table order."""
    runtimes = _runtimes
    return tuple(s for s in layer_symbols() if s in runtimes)


# Names of the registry before the layer-type table; kept working with a DeprecationWarning.
_DEPRECATED = {
    "LayerKind": ("LayerRuntime", lambda: LayerRuntime),
    "LAYER_KINDS": ("LAYER_RUNTIMES", lambda: LAYER_RUNTIMES),
    "layer_kind": ("layer_runtime", lambda: layer_runtime),
}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new, value = _DEPRECATED[name]
        warnings.warn(
            f"megatron_hybrid.modules.registry.{name} is deprecated; use {new} (a layer type is "
            "now registered once, with register_layer_type(facts, runtime))",
            DeprecationWarning,
            stacklevel=2,
        )
        return value()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

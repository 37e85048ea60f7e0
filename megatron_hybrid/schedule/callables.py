"""Fine-grained callables of one logical layer for the combined-1F1B schedule.

megatron-core's combined-1F1B schedule runs every logical layer as five slots:

``pre_dispatch_computation`` (compute) -> ``moe_dispatch`` (comm) -> ``mlp`` (compute) ->
``moe_combine`` (comm) -> ``mtp_post_process`` (compute)

and overlaps one micro-batch's communication slots with another's compute slots. A logical
layer here is a group such as ``[GE]`` or a single layer. Its members before the terminal MLP
(the *pre-layers*: ``*``, ``D``, ``+``, ``G``, ``M``) run in the pre-dispatch slot; the terminal
(``-`` or ``E``) supplies the rest through its layer type's
:class:`~megatron_hybrid.modules.registry.TerminalSlots` — for ``E`` the router after the
pre-layers, dispatch, the routed experts and combine; for ``-`` the MLP in the ``mlp`` slot. A
logical layer without an MLP does everything in the pre-dispatch slot. What each member runs and
which delayed weight gradients it owns come from its layer type's
:class:`~megatron_hybrid.modules.registry.LayerRuntime`; nothing here branches on a symbol.

With ``hybrid_cuda_graphs`` (:mod:`megatron_hybrid.schedule.graphs`) the submodules these slots
call — token mixers, dense MLPs, MoE routers and shared experts — replay CUDA graphs; dispatch,
routed experts and combine stay eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from megatron.core.utils import make_viewless_tensor
from torch import nn

from megatron_hybrid.modules import registry
from megatron_hybrid.modules.layer_types.common import layer_quant_context
from megatron_hybrid.modules.registry import (
    LAYER_RUNTIMES,
    LayerRuntime,
    ScheduleRole,
    TerminalSlots,
    layer_runtime,
)
from megatron_hybrid.pattern import SYMBOL_NAMES

__all__ = [
    "PRE_LAYER_RUNNERS",
    "LayerCallables",
    "UnschedulableLayerError",
    "build_layer_callables",
    "register_pre_layer_runner",
    "split_members",
]

_SLOT_NAMES = ("pre_dispatch_computation", "mlp")


class UnschedulableLayerError(ValueError):
    """A logical layer cannot be split into combined-1F1B slots."""


@dataclass
class LayerCallables:
    """The five slot callables of one logical layer and its delayed-wgrad callables."""

    forward: list  # pre_dispatch, dispatch, mlp, combine, mtp_post_process (None here)
    backward_dw: dict[str, list]
    is_moe: bool
    num_local_experts: int | None


Members = list[tuple[str, nn.Module]]


def _runtime(symbol) -> LayerRuntime:
    if not isinstance(symbol, str):
        raise UnschedulableLayerError(
            f"nested layer group {symbol!r} cannot be scheduled; flatten the group"
        )
    try:
        return layer_runtime(symbol)
    except ValueError as error:
        raise UnschedulableLayerError(str(error)) from None


def split_members(members: Members):
    """``(pre_layers, terminal)`` of a logical layer, refusing what cannot be scheduled.

    Raises:
        UnschedulableLayerError: a nested group, a terminal that is not last, or a member whose
            layer type cannot run in the pre-dispatch slot.
    """
    roles = [_runtime(symbol).schedule_role for symbol, _ in members]
    for position, ((symbol, _), role) in enumerate(zip(members, roles, strict=True)):
        if role != ScheduleRole.PRE_LAYER and position != len(members) - 1:
            raise UnschedulableLayerError(
                f"'{symbol}' must be the last member of a logical layer for EP overlap "
                f"(got {''.join(s for s, _ in members)!r}); put the MLP/MoE last"
            )
    has_terminal = roles[-1] != ScheduleRole.PRE_LAYER
    pre = members[:-1] if has_terminal else members
    for symbol, _ in pre:
        if _runtime(symbol).run_pre_dispatch is None:
            raise UnschedulableLayerError(
                f"{SYMBOL_NAMES.get(symbol, symbol)} ('{symbol}') layers cannot run before the "
                "MLP/MoE of an overlapped layer; give its LayerRuntime a run_pre_dispatch"
            )
    return pre, (members[-1] if has_terminal else None)


def _maybe_final_norm(node, hidden_states):
    """The decoder's final norm, in the last real slot of a chunk's last logical layer."""
    if node.is_mtp or not node.is_last_layer:
        return hidden_states
    final_norm = node.chunk_state.model.decoder.final_layernorm
    if final_norm is None:
        return hidden_states
    return make_viewless_tensor(inp=final_norm(hidden_states), requires_grad=True, keep_graph=True)


def _with_final_norm(function: Callable) -> Callable:
    def last_slot(node, *inputs):
        return _maybe_final_norm(node, function(node, *inputs))

    return last_slot


def _pre_dispatch(pre_layers: Members, tail: Callable | None) -> Callable:
    """The pre-dispatch slot: every pre-layer, then the terminal's tail (an MoE router)."""

    def pre_dispatch(node, hidden_states):
        for symbol, layer in pre_layers:
            with layer_quant_context(layer.config, layer.layer_number - 1):
                hidden_states = layer_runtime(symbol).run_pre_dispatch(layer, hidden_states, node)
            if isinstance(hidden_states, tuple):
                hidden_states = hidden_states[0]
        hidden_states = make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )
        return hidden_states if tail is None else tail(node, hidden_states)

    return pre_dispatch


def _identity(node, hidden_states):
    return hidden_states


def _not_moe(node, *args):
    raise RuntimeError("dispatch/combine slots are not used by a logical layer without MoE")


def _forward_slots(pre_layers: Members, slots: TerminalSlots) -> list:
    """The five forward slot callables; the decoder's final norm follows the last real one."""
    forward = [
        _pre_dispatch(pre_layers, slots.pre_dispatch_tail),
        slots.dispatch or _not_moe,
        slots.mlp or _identity,
        slots.combine or _not_moe,
        None,
    ]
    last = 3 if slots.combine else (2 if slots.mlp else 0)
    forward[last] = _with_final_norm(forward[last])
    return forward


def _backward_dw(members: Members) -> dict[str, list]:
    """Every member's delayed-wgrad callables, per slot, in member order."""
    backward_dw: dict[str, list] = {name: [] for name in _SLOT_NAMES}
    for symbol, layer in members:
        for slot, callables in layer_runtime(symbol).backward_dw(layer).items():
            backward_dw[slot].extend(callables)
    return backward_dw


def build_layer_callables(members: Members) -> LayerCallables:
    """Slot callables for a logical layer given as ``[(symbol, module), ...]``.

    Raises:
        UnschedulableLayerError: the layer cannot be split into slots.
    """
    pre_layers, terminal = split_members(members)
    if terminal is None:
        slots, is_moe = TerminalSlots(), False
    else:
        symbol, layer = terminal
        runtime = layer_runtime(symbol)
        slots = runtime.terminal_slots(layer)
        is_moe = runtime.schedule_role == ScheduleRole.MOE
    forward = _forward_slots(pre_layers, slots)
    return LayerCallables(forward, _backward_dw(members), is_moe, slots.num_local_experts)


class _PreLayerRunners(Mapping[str, Callable]):
    """Symbol -> pre-dispatch runner: a read-only view of the layer-type table."""

    def __getitem__(self, symbol: str) -> Callable:
        runner = LAYER_RUNTIMES[symbol].run_pre_dispatch
        if runner is None:
            raise KeyError(symbol)
        return runner

    def __iter__(self):
        return (s for s, r in LAYER_RUNTIMES.items() if r.run_pre_dispatch is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


#: Pre-layer symbol -> ``(layer, hidden_states, node) -> hidden_states`` (from the table).
PRE_LAYER_RUNNERS: Mapping[str, Callable] = _PreLayerRunners()


def register_pre_layer_runner(symbol: str, runner: Callable) -> None:
    """Deprecated: set ``run_pre_dispatch`` of a registered layer type instead.

    Replaces the pre-dispatch runner of the (registered) type ``symbol``.
    """
    warnings.warn(
        "register_pre_layer_runner is deprecated; give the layer type's LayerRuntime a "
        "run_pre_dispatch and register it with megatron_hybrid.modules.register_layer_type",
        DeprecationWarning,
        stacklevel=2,
    )
    registry._replace_runtime(replace(layer_runtime(symbol), run_pre_dispatch=runner))

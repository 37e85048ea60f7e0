"""Fine-grained callables of one logical layer for the combined-1F1B schedule.

megatron-core's combined-1F1B schedule runs every logical layer as five slots:

``pre_dispatch_computation`` (compute) -> ``moe_dispatch`` (comm) -> ``mlp`` (compute) ->
``moe_combine`` (comm) -> ``mtp_post_process`` (compute)

and overlaps one micro-batch's communication slots with another's compute slots. A logical
layer here is a group such as ``[GE]`` or a single layer. Its members before the terminal MLP
(the *pre-layers*: ``*``, ``D``, ``+``, ``G``, ``M``) run in the pre-dispatch slot, followed for
a terminal ``E`` by the pre-MLP norm, shared experts, router and dispatch preprocessing; the
routed experts run in the ``mlp`` slot between dispatch and combine. A terminal ``-`` runs its
whole MLP in the ``mlp`` slot; a logical layer without an MLP does everything in the
pre-dispatch slot. How each pre-layer symbol runs is a registry (:data:`PRE_LAYER_RUNNERS`).

Tensors that cross slots (residual, dispatched probabilities, shared-expert output) go through
``node.detach`` so each slot's backward runs exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.utils import make_viewless_tensor
from torch import nn

from megatron_hybrid.modules.hybrid_stack import layer_quant_context
from megatron_hybrid.pattern import ATTENTION, DSA, GDN, MAMBA, MLA, MLP, MOE, SYMBOL_NAMES

__all__ = [
    "PRE_LAYER_RUNNERS",
    "LayerCallables",
    "UnschedulableLayerError",
    "build_layer_callables",
    "register_pre_layer_runner",
]

_TERMINALS = (MLP, MOE)


class UnschedulableLayerError(ValueError):
    """A logical layer cannot be split into combined-1F1B slots."""


@dataclass
class LayerCallables:
    """The five slot callables of one logical layer and its delayed-wgrad callables."""

    forward: list  # pre_dispatch, dispatch, mlp, combine, mtp_post_process (None here)
    backward_dw: dict[str, list]
    is_moe: bool
    num_local_experts: int | None


def _run_attention_like(layer: nn.Module, hidden_states, node):
    """Input norm, attention (or GatedDeltaNet / MLA / DSA) and the residual add."""
    state = node.chunk_state
    hidden_states, _ = layer._forward_attention(
        hidden_states=hidden_states,
        attention_mask=state.attention_mask,
        rotary_pos_emb=state.rotary_pos_emb,
        rotary_pos_cos=getattr(state, "rotary_pos_cos", None),
        rotary_pos_sin=getattr(state, "rotary_pos_sin", None),
        packed_seq_params=state.packed_seq_params,
        sequence_len_offset=getattr(state, "sequence_len_offset", None),
        padding_mask=state.padding_mask,
    )
    return hidden_states


def _run_mamba(layer: nn.Module, hidden_states, node):
    """The whole Mamba layer (norm, mixer, residual add)."""
    state = node.chunk_state
    return layer(
        hidden_states=hidden_states,
        attention_mask=state.attention_mask,
        packed_seq_params=state.packed_seq_params,
    )


#: Pre-layer symbol -> ``(layer, hidden_states, node) -> hidden_states`` in the pre-dispatch slot.
PRE_LAYER_RUNNERS: dict[str, Callable] = {
    ATTENTION: _run_attention_like,
    DSA: _run_attention_like,
    MLA: _run_attention_like,
    GDN: _run_attention_like,
    MAMBA: _run_mamba,
}


def register_pre_layer_runner(symbol: str, runner: Callable) -> None:
    """Let layers of ``symbol`` run in the pre-dispatch slot of an overlapped layer."""
    PRE_LAYER_RUNNERS[symbol] = runner


def split_members(members: list[tuple[str, nn.Module]]):
    """``(pre_layers, terminal)`` of a logical layer, refusing what cannot be scheduled."""
    for position, (symbol, _) in enumerate(members):
        if not isinstance(symbol, str):
            raise UnschedulableLayerError(
                f"nested layer group {symbol!r} cannot be scheduled; flatten the group"
            )
        if symbol in _TERMINALS and position != len(members) - 1:
            raise UnschedulableLayerError(
                f"'{symbol}' must be the last member of a logical layer for EP overlap "
                f"(got {''.join(s for s, _ in members)!r}); put the MLP/MoE last"
            )
    has_terminal = members[-1][0] in _TERMINALS
    pre = members[:-1] if has_terminal else members
    for symbol, _ in pre:
        if symbol not in PRE_LAYER_RUNNERS:
            raise UnschedulableLayerError(
                f"{SYMBOL_NAMES.get(symbol, symbol)} ('{symbol}') layers cannot run before the "
                "MLP/MoE of an overlapped layer; register a runner with "
                "megatron_hybrid.schedule.register_pre_layer_runner"
            )
    return pre, (members[-1] if has_terminal else None)


class _ModuleBackwardDW:
    """Delayed weight gradients of the linear layers inside a module (e.g. a Mamba mixer)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.targets = [
            m
            for m in module.modules()
            if m is not module and callable(getattr(m, "backward_dw", None))
        ]

    def backward_dw(self):
        for target in self.targets:
            target.backward_dw()

    def parameters(self):
        return self.module.parameters()


class _MoEBackwardDW:
    """One part of an MoE layer's delayed wgrad: the routed or the shared experts.

    The slot that runs the wgrad fires the parameters' post-wgrad hooks (Megatron-FSDP's gradient
    reduction) right after it, so ``parameters()`` must name exactly the parameters whose wgrad
    this part computes: the whole MoE layer would also fire the other part's hooks too early.
    """

    def __init__(self, moe_layer: nn.Module, routed: bool):
        self.moe_layer, self.routed = moe_layer, routed

    def backward_dw(self):
        self.moe_layer.backward_dw(routed_experts=self.routed, shared_experts=not self.routed)

    def parameters(self):
        layer = self.moe_layer
        if self.routed:
            modules = [layer.experts]
        elif layer.use_shared_expert and not layer.shared_expert_overlap:
            modules = [layer.shared_experts]  # the condition of MoELayer.backward_dw
        else:
            modules = []
        if layer.config.moe_latent_size and layer.config.overlap_moe_expert_parallel_comm:
            # MoELayer.backward_dw runs the latent projections with the matching part.
            modules.append(layer.fc2_latent_proj if self.routed else layer.fc1_latent_proj)
        for module in modules:
            yield from module.parameters()


def _pre_layer_backward_dw(symbol: str, layer: nn.Module):
    if symbol == MAMBA or not hasattr(layer, "init_backward_dw_wrapper"):
        return _ModuleBackwardDW(layer)
    layer.init_backward_dw_wrapper()
    return layer.backward_dw_wrapper


def _flex_backend(config) -> str | None:
    if config.moe_token_dispatcher_type != "flex":
        return None
    return config.moe_flex_dispatcher_backend


def _maybe_final_norm(node, hidden_states):
    """The decoder's final norm, in the last real slot of a chunk's last logical layer."""
    if node.is_mtp or not node.is_last_layer:
        return hidden_states
    final_norm = node.chunk_state.model.decoder.final_layernorm
    if final_norm is None:
        return hidden_states
    return make_viewless_tensor(inp=final_norm(hidden_states), requires_grad=True, keep_graph=True)


def build_layer_callables(members: list[tuple[str, nn.Module]]) -> LayerCallables:
    """Slot callables for a logical layer given as ``[(symbol, module), ...]``.

    Raises:
        UnschedulableLayerError: the layer cannot be split into slots.
    """
    pre_layers, terminal = split_members(members)
    config = members[0][1].config
    flex = _flex_backend(config)
    terminal_symbol, terminal_layer = terminal if terminal else (None, None)
    is_moe = terminal_symbol == MOE

    def run_pre_layers(node, hidden_states):
        for symbol, layer in pre_layers:
            with layer_quant_context(config, layer.layer_number - 1):
                hidden_states = PRE_LAYER_RUNNERS[symbol](layer, hidden_states, node)
            if isinstance(hidden_states, tuple):
                hidden_states = hidden_states[0]
        return make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )

    def pre_dispatch(node, hidden_states):
        hidden_states = run_pre_layers(node, hidden_states)
        if terminal is None:
            return _maybe_final_norm(node, hidden_states)
        if not is_moe:
            return hidden_states
        layer = terminal_layer
        with layer_quant_context(config, layer.layer_number - 1):
            normed = layer._forward_pre_mlp_layernorm(hidden_states)
            if isinstance(normed, tuple):  # fused residual norm returns (output, residual)
                normed, residual = normed
            else:
                residual = hidden_states
            if config.fp32_residual_connection:
                residual = residual.float()
            padding_mask = node.chunk_state.padding_mask
            if padding_mask is not None:
                padding_mask = padding_mask.transpose(0, 1).bool()
            shared_output = layer.mlp.shared_experts_compute(normed)
            probs, routing_map = layer.mlp.route(normed, padding_mask)
            local_tokens, probs = layer.mlp.preprocess(normed, probs, routing_map)
        node.layer_state.mlp_norm_manager = layer.mlp_norm_manager
        layer.mlp_norm_manager = None
        node.layer_state.residual = node.detach(residual)
        if layer.mlp.use_shared_expert and not layer.mlp.shared_expert_overlap:
            node.layer_state.shared_expert_output = node.detach(shared_output)
        return local_tokens, probs

    def dispatch(node, local_tokens, probs):
        mlp = terminal_layer.mlp
        if flex is not None:
            # The detached probs, so the dispatch graph does not reach into the previous slot.
            mlp.token_dispatcher._comm_manager.token_probs = probs
        dispatched_tokens, dispatched_probs = mlp.dispatch(local_tokens, probs)
        # Through layer_state rather than as a slot input, so free_input cannot free it.
        node.layer_state.dispatched_probs = node.detach(dispatched_probs)
        return dispatched_tokens

    def experts(node, dispatched_tokens):
        layer, mlp = terminal_layer, terminal_layer.mlp
        probs = node.layer_state.dispatched_probs
        if flex is not None:
            mlp.token_dispatcher._comm_manager.dispatched_probs = probs
        with layer_quant_context(config, layer.layer_number - 1):
            expert_output, _ = mlp.routed_experts_compute(dispatched_tokens, probs)
        if flex == "hybridep":
            # Produced on the comm stream; keep a reference until the experts have run.
            node.layer_state.tokens_per_expert = (
                mlp.token_dispatcher._comm_manager.get_number_of_tokens_per_expert()
            )
        if layer.recompute_pre_mlp_layernorm:
            # The one recompute hook of the pre-MLP norm; combine must not add a second one.
            layer.pre_mlp_norm_checkpoint.discard_output_and_register_recompute(expert_output)
        return expert_output

    def combine(node, expert_output):
        layer, state = terminal_layer, node.layer_state
        residual = state.residual
        shared_output = getattr(state, "shared_expert_output", None)
        output = layer.mlp.combine(expert_output)
        output = layer.mlp.postprocess(output, shared_output)
        with layer.bias_dropout_add_exec_handler():
            hidden_states = layer.mlp_bda(layer.training, config.bias_dropout_fusion)(
                (output, None), residual, layer.hidden_dropout
            )
        manager = getattr(state, "mlp_norm_manager", None)
        if manager is not None:
            hidden_states = manager.group_offload(hidden_states, forced_released_tensors=[residual])
        hidden_states = make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )
        # Made on the compute stream, read on the communication stream.
        residual.record_stream(torch.cuda.current_stream())
        if shared_output is not None:
            shared_output.record_stream(torch.cuda.current_stream())
        state.residual = state.shared_expert_output = state.mlp_norm_manager = None
        return _maybe_final_norm(node, hidden_states)

    def dense_mlp(node, hidden_states):
        layer = terminal_layer
        with layer_quant_context(config, layer.layer_number - 1):
            hidden_states = layer._forward_mlp(
                hidden_states,
                padding_mask=node.chunk_state.padding_mask,
                packed_seq_params=node.chunk_state.packed_seq_params,
            )
        return _maybe_final_norm(node, hidden_states)

    def identity(node, hidden_states):
        return hidden_states

    def not_moe(node, *args):
        raise RuntimeError("dispatch/combine slots are not used by a logical layer without MoE")

    forward = [
        pre_dispatch,
        dispatch if is_moe else not_moe,
        experts if is_moe else (dense_mlp if terminal else identity),
        combine if is_moe else not_moe,
        None,
    ]

    pre_dispatch_dw = [_pre_layer_backward_dw(symbol, layer) for symbol, layer in pre_layers]
    mlp_dw = []
    if terminal is not None and not is_moe:
        mlp_dw.append(terminal_layer.mlp)
    if is_moe:
        moe = terminal_layer.mlp
        mlp_dw.append(_MoEBackwardDW(moe, routed=True))
        # TE queues the shared-expert (and latent down-projection) wgrad during the pre-dispatch
        # backward: run it there. A no-op for an MoE layer without either.
        pre_dispatch_dw.append(_MoEBackwardDW(moe, routed=False))
    backward_dw = {"pre_dispatch_computation": pre_dispatch_dw, "mlp": mlp_dw}
    num_local_experts = terminal_layer.mlp.num_local_experts if is_moe else None
    return LayerCallables(forward, backward_dw, is_moe, num_local_experts)

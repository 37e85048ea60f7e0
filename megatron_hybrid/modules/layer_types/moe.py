"""Runtime of ``E`` (MoE): the MoE half of a GPT ``MoETransformerLayer``.

In the EP-overlap schedule an MoE layer ends its logical layer and is split over four slots:

* pre-dispatch (after the pre-layers): pre-MLP norm, shared experts, router and dispatch
  preprocessing;
* dispatch (communication): tokens to their experts' ranks;
* ``mlp`` (compute): the routed experts;
* combine (communication): tokens back, shared-expert output added, residual add.

Tensors that cross slots (residual, dispatched probabilities, shared-expert output) go through
``node.detach`` so each slot's backward runs exactly once. Its delayed weight gradients are split
the same way: routed experts in the ``mlp`` slot, shared experts in the pre-dispatch slot.
"""

from __future__ import annotations

import torch
from megatron.core.utils import make_viewless_tensor
from torch import Tensor, nn

from megatron_hybrid.modules.flops import SequenceBatch, linear_flops
from megatron_hybrid.modules.layer_types.common import (
    MLP_SLOT,
    PRE_DISPATCH,
    build_transformer_layer,
    delayed_wgrad_reason,
    forward_transformer_layer,
    layer_quant_context,
)
from megatron_hybrid.modules.layer_types.mlp import mlp_flops
from megatron_hybrid.modules.registry import (
    GraphPiece,
    LayerRuntime,
    ScheduleRole,
    TerminalSlots,
)
from megatron_hybrid.pattern import MOE

__all__ = ["RUNTIME", "MoEBackwardDW", "flops", "graph_pieces", "terminal_slots"]


def _flex_backend(config) -> str | None:
    if config.moe_token_dispatcher_type != "flex":
        return None
    return config.moe_flex_dispatcher_backend


def terminal_slots(layer: nn.Module) -> TerminalSlots:
    """The MoE layer's four slot functions (see the module docstring)."""
    config = layer.config
    flex = _flex_backend(config)
    mlp = layer.mlp

    def route(node, hidden_states: Tensor):
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
            shared_output = mlp.shared_experts_compute(normed)
            probs, routing_map = mlp.route(normed, padding_mask)
            local_tokens, probs = mlp.preprocess(normed, probs, routing_map)
        node.layer_state.mlp_norm_manager = layer.mlp_norm_manager
        layer.mlp_norm_manager = None
        node.layer_state.residual = node.detach(residual)
        if mlp.use_shared_expert and not mlp.shared_expert_overlap:
            node.layer_state.shared_expert_output = node.detach(shared_output)
        return local_tokens, probs

    def dispatch(node, local_tokens: Tensor, probs: Tensor) -> Tensor:
        if flex is not None:
            # The detached probs, so the dispatch graph does not reach into the previous slot.
            mlp.token_dispatcher._comm_manager.token_probs = probs
        dispatched_tokens, dispatched_probs = mlp.dispatch(local_tokens, probs)
        # Through layer_state rather than as a slot input, so free_input cannot free it.
        node.layer_state.dispatched_probs = node.detach(dispatched_probs)
        return dispatched_tokens

    def experts(node, dispatched_tokens: Tensor) -> Tensor:
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

    def combine(node, expert_output: Tensor) -> Tensor:
        state = node.layer_state
        residual = state.residual
        shared_output = getattr(state, "shared_expert_output", None)
        output = mlp.postprocess(mlp.combine(expert_output), shared_output)
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
        return hidden_states

    return TerminalSlots(
        pre_dispatch_tail=route,
        dispatch=dispatch,
        mlp=experts,
        combine=combine,
        num_local_experts=mlp.num_local_experts,
    )


class MoEBackwardDW:
    """One part of an MoE layer's delayed wgrad: the routed or the shared experts.

    The slot that runs the wgrad fires the parameters' post-wgrad hooks (Megatron-FSDP's gradient
    reduction) right after it, so ``parameters()`` must name exactly the parameters whose wgrad
    this part computes: the whole MoE layer would also fire the other part's hooks too early.
    """

    def __init__(self, moe_layer: nn.Module, routed: bool):
        self.moe_layer, self.routed = moe_layer, routed

    def backward_dw(self) -> None:
        """Run this part's delayed weight gradients."""
        self.moe_layer.backward_dw(routed_experts=self.routed, shared_experts=not self.routed)

    def parameters(self):
        """The parameters whose weight gradients this part computes."""
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


def backward_dw(layer: nn.Module) -> dict[str, list]:
    """Routed experts in the ``mlp`` slot; shared experts in the pre-dispatch slot.

    TE queues the shared-expert (and latent down-projection) wgrad during the pre-dispatch
    backward, so it runs there; a no-op for an MoE layer without either.
    """
    return {
        MLP_SLOT: [MoEBackwardDW(layer.mlp, routed=True)],
        PRE_DISPATCH: [MoEBackwardDW(layer.mlp, routed=False)],
    }


_DYNAMIC_TOKENS = (
    "dropless routing sends each expert and rank a data-dependent number of tokens: dynamic "
    "shapes, and the dispatcher copies the counts to the host (megatron-core 0.19.2 refuses "
    "to graph the experts under EP overlap too)"
)
_COMMUNICATION = "all-to-all communication with data-dependent split sizes read on the host"
_SHARED_OVERLAP = "moe_shared_expert_overlap runs the shared experts on a side stream"


def _experts_reason(moe: nn.Module) -> str | None:
    """Why the routed experts stay eager, or None where their inputs have fixed shapes and no
    host copy: a dispatcher that keeps the token counts on the device (the fast path's at EP 1)
    feeding experts that read them there (``takes_device_counts``: grouped-GEMM experts)."""
    dispatcher_copies = getattr(moe.token_dispatcher, "fast_path_reason", "megatron's")
    if dispatcher_copies is None and getattr(moe.experts, "takes_device_counts", False):
        return delayed_wgrad_reason(moe.experts)
    return _DYNAMIC_TOKENS


def _whole_layer_reason(moe: nn.Module) -> str | None:
    """Why the MoE layer is not captured whole, or None: on the fast path at EP 1 and expert
    TP 1, where the dispatcher neither copies token counts to the host nor communicates, and its
    gathers and the grouped-GEMM experts see fixed shapes (``tokens x top-k`` rows)."""
    dispatcher = getattr(moe, "fast_path_reason", "megatron's dispatcher")
    if dispatcher is not None:
        return dispatcher
    experts = _experts_reason(moe)
    if experts is not None:
        return experts
    if moe.use_shared_expert and moe.shared_expert_overlap:
        return _SHARED_OVERLAP
    return delayed_wgrad_reason(moe)


def graph_pieces(layer: nn.Module) -> dict[str, GraphPiece]:
    """The whole layer where nothing in it reads the host (the fast path at EP 1); else the
    router and the shared experts are captured, dispatch and combine are not, and the routed
    experts only where nothing reads the token counts on the host.

    The router maps ``[tokens, hidden]`` to fixed-shape probabilities and a routing map, with no
    host sync. Dispatch preprocessing (``MoELayer.preprocess``) of the ``alltoall`` dispatcher
    counts tokens per expert and copies the split sizes to the host for the all-to-all
    (``token_dispatcher.py``, megatron-core 0.19.2), so it stays eager with everything after it,
    except on the fast path at EP 1, where the counts stay on the device, the all-to-alls are
    the identity and every shape is fixed: there ``MoELayer.forward`` (router, permutation,
    experts, unpermutation, shared experts) is one piece, one graph launch per micro-batch
    instead of two graphs with the permutation's eager operators between them (EP overlap,
    which calls the steps one by one, needs EP > 1).
    """
    moe = layer.mlp
    if _whole_layer_reason(moe) is None:
        return {"moe": GraphPiece(moe)}
    pieces = {
        "router": GraphPiece(moe.router, delayed_wgrad_reason(moe.router)),
        "dispatch_preprocess": GraphPiece(moe, _DYNAMIC_TOKENS),
        "dispatch": GraphPiece(moe, _COMMUNICATION),
        "experts": GraphPiece(moe.experts, _experts_reason(moe)),
        "combine": GraphPiece(moe, _COMMUNICATION),
    }
    if moe.use_shared_expert:
        reason = delayed_wgrad_reason(moe.shared_experts)
        if moe.shared_expert_overlap:
            reason = _SHARED_OVERLAP
        pieces["shared_experts"] = GraphPiece(moe.shared_experts, reason)
    return pieces


def flops(config, batch: SequenceBatch) -> dict[str, float]:
    """Forward FLOPs: the router, the ``moe_router_topk`` experts each token is routed to (on
    the ``moe_latent_size`` width with its two projections, where set), the shared experts and
    their gate."""
    tokens, hidden = batch.tokens, config.hidden_size
    topk, gated = config.moe_router_topk, config.gated_linear_unit
    width = config.moe_latent_size or hidden
    expert = mlp_flops(tokens, width, config.moe_ffn_hidden_size, gated)
    parts = {
        "router": linear_flops(tokens, hidden, config.num_moe_experts),
        "experts_fc1": topk * expert["fc1"],
        "experts_fc2": topk * expert["fc2"],
    }
    if config.moe_latent_size:
        parts["latent_proj"] = 2 * linear_flops(tokens, hidden, config.moe_latent_size)
    if config.moe_shared_expert_intermediate_size:
        shared = mlp_flops(tokens, hidden, config.moe_shared_expert_intermediate_size, gated)
        parts["shared_experts"] = shared["fc1"] + shared["fc2"]
        if config.moe_shared_expert_gate:
            parts["shared_experts"] += linear_flops(tokens, hidden, 1)
    return parts


RUNTIME = LayerRuntime(
    symbol=MOE,
    spec_field="moe_layer",
    build=build_transformer_layer(attention=False),
    forward=forward_transformer_layer,
    schedule_role=ScheduleRole.MOE,
    terminal_slots=terminal_slots,
    backward_dw=backward_dw,
    graph_pieces=graph_pieces,
    flops=flops,
)

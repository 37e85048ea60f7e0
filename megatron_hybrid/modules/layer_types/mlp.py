"""Runtime of ``-`` (dense MLP): the MLP half of a GPT ``TransformerLayer``.

In the EP-overlap schedule a dense MLP ends its logical layer: its whole MLP half (pre-MLP norm,
MLP, residual add) runs in the ``mlp`` slot, and its weight gradients are delayed there.
"""

from __future__ import annotations

from torch import Tensor, nn

from megatron_hybrid.modules.flops import SequenceBatch, linear_flops
from megatron_hybrid.modules.layer_types.common import (
    MLP_SLOT,
    build_transformer_layer,
    delayed_wgrad_reason,
    forward_transformer_layer,
    layer_quant_context,
)
from megatron_hybrid.modules.registry import (
    GraphPiece,
    LayerRuntime,
    ScheduleRole,
    TerminalSlots,
)
from megatron_hybrid.pattern import MLP


def terminal_slots(layer: nn.Module) -> TerminalSlots:
    """The MLP half in the ``mlp`` slot."""

    def mlp(node, hidden_states: Tensor) -> Tensor:
        with layer_quant_context(layer.config, layer.layer_number - 1):
            return layer._forward_mlp(
                hidden_states,
                padding_mask=node.chunk_state.padding_mask,
                packed_seq_params=node.chunk_state.packed_seq_params,
            )

    return TerminalSlots(mlp=mlp)


def backward_dw(layer: nn.Module) -> dict[str, list]:
    """The MLP's linear layers, in the ``mlp`` slot."""
    return {MLP_SLOT: [layer.mlp]}


def graph_pieces(layer: nn.Module) -> dict[str, GraphPiece]:
    """The MLP is captured (the pre-MLP norm and residual add stay eager)."""
    return {"mlp": GraphPiece(layer.mlp, delayed_wgrad_reason(layer.mlp))}


def mlp_flops(tokens: int, hidden: int, ffn: int, gated: bool) -> dict[str, float]:
    """An MLP's two projections; a gated linear unit (SwiGLU, GeGLU) doubles the first."""
    return {
        "fc1": linear_flops(tokens, hidden, ffn * (2 if gated else 1)),
        "fc2": linear_flops(tokens, ffn, hidden),
    }


def flops(config, batch: SequenceBatch) -> dict[str, float]:
    """Forward FLOPs of the dense MLP (``ffn_hidden_size``)."""
    return mlp_flops(
        batch.tokens, config.hidden_size, config.ffn_hidden_size, config.gated_linear_unit
    )


RUNTIME = LayerRuntime(
    symbol=MLP,
    spec_field="mlp_layer",
    build=build_transformer_layer(attention=False),
    forward=forward_transformer_layer,
    schedule_role=ScheduleRole.DENSE_MLP,
    terminal_slots=terminal_slots,
    backward_dw=backward_dw,
    graph_pieces=graph_pieces,
    flops=flops,
)

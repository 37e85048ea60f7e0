"""Runtime of ``M`` (Mamba): megatron-core's ``MambaLayer`` (norm, mixer, residual add).

A ``MambaLayer`` is not a ``TransformerLayer``: it takes ``pp_layer_offset`` but none of the
attention arguments, runs whole in the pre-dispatch slot, and its delayed weight gradients are
those of the linear layers inside it (it has no wrapper of its own).
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import build_module
from torch import Tensor, nn

from megatron_hybrid.modules.layer_types.common import (
    PRE_DISPATCH,
    ModuleBackwardDW,
    mixer_graph_pieces,
)
from megatron_hybrid.modules.registry import (
    LayerBuildArgs,
    LayerInputs,
    LayerRuntime,
    ScheduleRole,
)
from megatron_hybrid.pattern import MAMBA


def build(spec, args: LayerBuildArgs) -> nn.Module:
    """Build a ``MambaLayer`` at its global layer number."""
    return build_module(
        spec,
        config=args.config,
        layer_number=args.layer_number,
        pp_layer_offset=args.stage_offset,
        pg_collection=args.pg_collection,
        name=args.name,
    )


def forward(layer: nn.Module, hidden_states: Tensor, inputs: LayerInputs) -> Tensor:
    """Call a ``MambaLayer`` with the stack's inputs."""
    return layer(
        hidden_states=hidden_states,
        attention_mask=inputs.attention_mask,
        inference_context=inputs.inference_context,
        packed_seq_params=inputs.packed_seq_params,
    )


def run_pre_dispatch(layer: nn.Module, hidden_states: Tensor, node) -> Tensor:
    """The whole Mamba layer in the pre-dispatch slot."""
    state = node.chunk_state
    return layer(
        hidden_states=hidden_states,
        attention_mask=state.attention_mask,
        packed_seq_params=state.packed_seq_params,
    )


def backward_dw(layer: nn.Module) -> dict[str, list]:
    """The mixer's linear layers, in the pre-dispatch slot."""
    return {PRE_DISPATCH: [ModuleBackwardDW(layer)]}


RUNTIME = LayerRuntime(
    symbol=MAMBA,
    spec_field="mamba_layer",
    build=build,
    forward=forward,
    schedule_role=ScheduleRole.PRE_LAYER,
    run_pre_dispatch=run_pre_dispatch,
    backward_dw=backward_dw,
    graph_pieces=mixer_graph_pieces("mixer"),
)

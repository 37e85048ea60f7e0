"""Runtime of ``*`` (attention): the attention half of a GPT ``TransformerLayer``."""

from __future__ import annotations

from megatron_hybrid.modules.layer_types.common import (
    build_transformer_layer,
    forward_transformer_layer,
    mixer_graph_pieces,
    pre_layer_backward_dw,
    run_attention_half,
)
from megatron_hybrid.modules.registry import LayerRuntime, ScheduleRole
from megatron_hybrid.pattern import ATTENTION

RUNTIME = LayerRuntime(
    symbol=ATTENTION,
    spec_field="attention_layer",
    build=build_transformer_layer(attention=True),
    forward=forward_transformer_layer,
    schedule_role=ScheduleRole.PRE_LAYER,
    run_pre_dispatch=run_attention_half,
    backward_dw=pre_layer_backward_dw,
    graph_pieces=mixer_graph_pieces("self_attention"),
)

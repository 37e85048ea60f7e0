"""Runtime of ``G`` (GatedDeltaNet): a ``TransformerLayer`` whose ``self_attention`` is GDN.

megatron-core builds GatedDeltaNet as the attention half of a ``TransformerLayer`` without the
attention-only constructor arguments; it runs like one in the pre-dispatch slot.
"""

from __future__ import annotations

from megatron_hybrid.modules.layer_types.common import (
    build_transformer_layer,
    forward_transformer_layer,
    mixer_graph_pieces,
    pre_layer_backward_dw,
    run_attention_half,
)
from megatron_hybrid.modules.registry import LayerRuntime, ScheduleRole
from megatron_hybrid.pattern import GDN

RUNTIME = LayerRuntime(
    symbol=GDN,
    spec_field="gdn_layer",
    build=build_transformer_layer(attention=False),
    forward=forward_transformer_layer,
    schedule_role=ScheduleRole.PRE_LAYER,
    run_pre_dispatch=run_attention_half,
    backward_dw=pre_layer_backward_dw,
    graph_pieces=mixer_graph_pieces("self_attention"),
)

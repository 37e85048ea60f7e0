"""Runtime of ``M`` (Mamba): megatron-core's ``MambaLayer`` (norm, mixer, residual add).

A ``MambaLayer`` is not a ``TransformerLayer``: it takes ``pp_layer_offset`` but none of the
attention arguments, runs whole in the pre-dispatch slot, and its delayed weight gradients are
those of the linear layers inside it (it has no wrapper of its own).
"""

from __future__ import annotations

import functools
import inspect

from megatron.core.transformer.spec_utils import build_module
from torch import Tensor, nn

from megatron_hybrid.modules.flops import SequenceBatch, linear_flops
from megatron_hybrid.modules.layer_types.common import (
    PRE_DISPATCH,
    ModuleBackwardDW,
    mixer_graph_pieces,
)
from megatron_hybrid.modules.mamba_torch import TorchMambaMixer
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


@functools.cache
def _mixer_defaults() -> dict:
    """The mixer's constructor defaults (``d_conv``, ``expand``, ``chunk_size``), which the
    specs leave as they are; the torch mixer keeps megatron-core's ``MambaMixer`` values."""
    parameters = inspect.signature(TorchMambaMixer.__init__).parameters
    return {name: parameters[name].default for name in ("d_conv", "expand", "chunk_size")}


def flops(config, batch: SequenceBatch) -> dict[str, float]:
    """Forward FLOPs: input projection (z, x, B, C, dt), depthwise causal conv on x|B|C, the
    chunked SSD scan, output projection.

    Per token, with chunks of ``Q`` steps, ``H`` heads of ``P`` channels, ``G`` groups of
    state ``N``: causal ``C B^T`` per group (``(Q+1) N``), its product with the inputs per head
    (``(Q+1) P``), each chunk's state from its inputs and each step's read of the carried state
    (``2 x 2 N P`` per head); the state passing between chunks is ``O(N P)`` per chunk.
    """
    defaults = _mixer_defaults()
    tokens, hidden = batch.tokens, config.hidden_size
    head_dim, state, groups = config.mamba_head_dim, config.mamba_state_dim, config.mamba_num_groups
    if config.mamba_num_heads is not None:
        heads = config.mamba_num_heads
    else:
        heads = defaults["expand"] * hidden // head_dim
    d_inner, q = heads * head_dim, defaults["chunk_size"]
    per_token = groups * (q + 1) * state + heads * ((q + 1) * head_dim + 4 * state * head_dim)
    return {
        "in_proj": linear_flops(tokens, hidden, 2 * d_inner + 2 * groups * state + heads),
        "conv": 2 * tokens * (d_inner + 2 * groups * state) * defaults["d_conv"],
        "ssd_scan": tokens * per_token,
        "out_proj": linear_flops(tokens, d_inner, hidden),
    }


RUNTIME = LayerRuntime(
    symbol=MAMBA,
    spec_field="mamba_layer",
    build=build,
    forward=forward,
    schedule_role=ScheduleRole.PRE_LAYER,
    run_pre_dispatch=run_pre_dispatch,
    backward_dw=backward_dw,
    graph_pieces=mixer_graph_pieces("mixer"),
    flops=flops,
)

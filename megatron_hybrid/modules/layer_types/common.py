"""Runtime pieces that several built-in layer types share.

Every built-in type except Mamba is a megatron-core ``TransformerLayer`` holding one half of a
GPT layer, so they share a builder, a forward call, the attention-half runner of the schedule's
pre-dispatch slot and the delayed weight-gradient wrapper that ``TransformerLayer`` provides.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from megatron.core.enums import Fp8Recipe
from megatron.core.fp4_utils import get_fp4_context
from megatron.core.fp8_utils import get_fp8_context
from megatron.core.transformer.spec_utils import build_module
from torch import Tensor, nn

from megatron_hybrid.modules.registry import (
    GraphPiece,
    LayerBuildArgs,
    LayerInputs,
    LayerRuntime,
    ScheduleRole,
)

__all__ = [
    "ModuleBackwardDW",
    "attention_half_runtime",
    "build_transformer_layer",
    "delayed_wgrad_reason",
    "mixer_graph_pieces",
    "forward_transformer_layer",
    "layer_quant_context",
    "pre_layer_backward_dw",
    "run_attention_half",
]

PRE_DISPATCH = "pre_dispatch_computation"
MLP_SLOT = "mlp"


def layer_quant_context(config, physical_index: int):
    """Per-layer context: FP8 recipes other than 'delayed' and FP4 are applied layer by layer."""
    if config.fp8 and config.fp8_recipe != Fp8Recipe.delayed:
        return get_fp8_context(config, physical_index)
    if config.fp4:
        return get_fp4_context(config, physical_index)
    return nullcontext()


def build_transformer_layer(*, attention: bool) -> Callable[[Any, LayerBuildArgs], nn.Module]:
    """A builder for ``TransformerLayer`` specs (``attention``: pass the attention-only args)."""

    def build(spec, args: LayerBuildArgs) -> nn.Module:
        kwargs = dict(
            config=args.config,
            layer_number=args.layer_number,
            pg_collection=args.pg_collection,
            # layer_number is already global; megatron must not add a PP offset again.
            add_layer_offset=False,
            name=args.name,
        )
        if attention:
            kwargs.update(is_mtp_layer=args.is_mtp_layer, pp_layer_offset=args.stage_offset)
        return build_module(spec, **kwargs)

    return build


def forward_transformer_layer(layer: nn.Module, hidden_states: Tensor, inputs: LayerInputs):
    """Call a ``TransformerLayer`` with the stack's inputs; return its hidden states."""
    hidden_states, _ = layer(
        hidden_states=hidden_states,
        attention_mask=inputs.attention_mask,
        rotary_pos_emb=inputs.rotary_pos_emb,
        rotary_pos_cos=inputs.rotary_pos_cos,
        rotary_pos_sin=inputs.rotary_pos_sin,
        rotary_pos_cos_sin=inputs.rotary_pos_cos_sin,
        inference_context=inputs.inference_context,
        packed_seq_params=inputs.packed_seq_params,
        sequence_len_offset=inputs.sequence_len_offset,
        padding_mask=inputs.padding_mask,
    )
    return hidden_states


def run_attention_half(layer: nn.Module, hidden_states: Tensor, node) -> Tensor:
    """Pre-dispatch slot: input norm, attention (or GatedDeltaNet / MLA / DSA), residual add."""
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


class ModuleBackwardDW:
    """Delayed weight gradients of the linear layers inside a module (e.g. a Mamba mixer)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.targets = [
            m
            for m in module.modules()
            if m is not module and callable(getattr(m, "backward_dw", None))
        ]

    def backward_dw(self) -> None:
        """Run every inner linear layer's delayed weight gradient."""
        for target in self.targets:
            target.backward_dw()

    def parameters(self):
        """The module's parameters (the slot fires their post-wgrad hooks)."""
        return self.module.parameters()


def pre_layer_backward_dw(layer: nn.Module) -> dict[str, list]:
    """A pre-layer's delayed wgrad, in the pre-dispatch slot.

    A ``TransformerLayer`` has its own wrapper (``init_backward_dw_wrapper``); any other module
    gets :class:`ModuleBackwardDW` over its linear layers.
    """
    if hasattr(layer, "init_backward_dw_wrapper"):
        layer.init_backward_dw_wrapper()
        return {PRE_DISPATCH: [layer.backward_dw_wrapper]}
    return {PRE_DISPATCH: [ModuleBackwardDW(layer)]}


_TE_MODULES = ("transformer_engine", "megatron.core.extensions.transformer_engine")


def delayed_wgrad_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot be captured under ``delay_wgrad_compute``, or None.

    TransformerEngine's linears then queue their weight gradient in Python during backward and
    compute it in ``backward_dw``; a replayed backward graph runs no Python, so the queue would
    stay empty (megatron-core 0.19.2 captures a separate wgrad graph for this,
    ``transformer/cuda_graphs.py``, which this package does not). Local linears compute their
    weight gradients in backward and are captured with it.
    """
    config = getattr(module, "config", None)
    if config is None or not config.delay_wgrad_compute:
        return None
    for inner in module.modules():
        if type(inner).__module__.startswith(_TE_MODULES) and hasattr(inner, "backward_dw"):
            return (
                "delay_wgrad_compute with TransformerEngine linears: their delayed weight "
                "gradient is queued by Python in backward, which a replayed graph does not run"
            )
    return None


def mixer_graph_pieces(
    attribute: str, unverified: str | None = None
) -> Callable[[nn.Module], dict[str, GraphPiece]]:
    """``graph_pieces`` of a pre-layer: its token mixer ``layer.<attribute>``.

    The mixer (attention, GatedDeltaNet, Mamba) is captured; the norm before it and the residual
    add after it are one or two small kernels each and stay eager.

    Args:
        attribute: the mixer's attribute on the layer (``self_attention``, ``mixer``).
        unverified: if given, the mixer stays eager with this reason.
    """

    def pieces(layer: nn.Module) -> dict[str, GraphPiece]:
        mixer = getattr(layer, attribute)
        reason = unverified or delayed_wgrad_reason(mixer)
        if reason is None and layer.config.attention_dropout > 0.0:
            if hasattr(mixer, "core_attention"):  # attention; GatedDeltaNet and Mamba have none
                reason = (
                    "attention dropout draws from megatron's CUDA RNG tracker, whose state a "
                    "replayed graph does not advance; set attention_dropout=0"
                )
        # The mixer and its core attention, if any, say whether they read packed boundaries on
        # the device only (FastSelfAttention and SDPACoreAttention, GatedDeltaNet on fla).
        inner = [m for m in (mixer, getattr(mixer, "core_attention", None)) if m is not None]
        packed = all(getattr(m, "reads_fixed_packed_on_device", False) for m in inner)
        return {"mixer": GraphPiece(mixer, reason, packed)}

    return pieces


def attention_half_runtime(
    symbol: str,
    spec_field: str,
    *,
    attention: bool = True,
    unverified: str | None = None,
    flops: Callable | None = None,
) -> LayerRuntime:
    """The runtime of a type that is the attention half of a ``TransformerLayer``.

    ``*``, ``D``, ``+`` and ``G`` differ only in their symbol, spec field, whether the layer
    takes the attention-only constructor arguments, and whether their mixer is verified under
    CUDA graph capture.

    Args:
        symbol: the pattern symbol.
        spec_field: the ``HybridStackSubmodules`` field holding the layer spec.
        attention: pass ``TransformerLayer``'s attention-only arguments (False for GDN).
        unverified: if given, the mixer is not graphed, for this reason.
        flops: the type's FLOP formula (``LayerRuntime.flops``).
    """
    return LayerRuntime(
        symbol=symbol,
        spec_field=spec_field,
        build=build_transformer_layer(attention=attention),
        forward=forward_transformer_layer,
        schedule_role=ScheduleRole.PRE_LAYER,
        run_pre_dispatch=run_attention_half,
        backward_dw=pre_layer_backward_dw,
        graph_pieces=mixer_graph_pieces("self_attention", unverified=unverified),
        flops=flops,
    )

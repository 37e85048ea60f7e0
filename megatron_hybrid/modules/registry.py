"""Layer kinds of a hybrid stack: one registry entry per pattern symbol.

Each entry says which field of :class:`~megatron_hybrid.modules.specs.HybridStackSubmodules`
holds the symbol's spec, how to build a layer from it, and how to call that layer. Generic code
(the stack, recompute, the EP-overlap plan) looks symbols up here instead of branching on them,
so a new layer type is one :func:`register_layer_kind` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.spec_utils import build_module
from torch import Tensor, nn

from megatron_hybrid.pattern import ATTENTION, DSA, GDN, MAMBA, MLA, MLP, MOE

__all__ = [
    "LAYER_KINDS",
    "LayerBuildArgs",
    "LayerInputs",
    "LayerKind",
    "layer_kind",
    "register_layer_kind",
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


@dataclass(frozen=True)
class LayerKind:
    """How one pattern symbol becomes a layer and how that layer is called.

    Attributes:
        symbol: the pattern symbol.
        description: human name, used in messages.
        spec_field: the HybridStackSubmodules field holding the symbol's spec.
        build: ``(spec, LayerBuildArgs) -> nn.Module``.
        forward: ``(layer, hidden_states, LayerInputs) -> hidden_states``.
    """

    symbol: str
    description: str
    spec_field: str
    build: Callable[[Any, LayerBuildArgs], nn.Module]
    forward: Callable[[nn.Module, Tensor, LayerInputs], Tensor]


def _transformer_layer_builder(*, attention: bool) -> Callable[[Any, LayerBuildArgs], nn.Module]:
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


def _build_mamba(spec, args: LayerBuildArgs) -> nn.Module:
    return build_module(
        spec,
        config=args.config,
        layer_number=args.layer_number,
        pp_layer_offset=args.stage_offset,
        pg_collection=args.pg_collection,
        name=args.name,
    )


def _forward_transformer_layer(layer: nn.Module, hidden_states: Tensor, inputs: LayerInputs):
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


def _forward_mamba_layer(layer: nn.Module, hidden_states: Tensor, inputs: LayerInputs):
    return layer(
        hidden_states=hidden_states,
        attention_mask=inputs.attention_mask,
        inference_context=inputs.inference_context,
        packed_seq_params=inputs.packed_seq_params,
    )


#: Pattern symbol -> LayerKind.
LAYER_KINDS: dict[str, LayerKind] = {}


def register_layer_kind(kind: LayerKind) -> None:
    """Register how a pattern symbol is built and called.

    Raises:
        ValueError: the symbol is already registered.
    """
    if kind.symbol in LAYER_KINDS:
        raise ValueError(f"layer kind for symbol {kind.symbol!r} is already registered")
    LAYER_KINDS[kind.symbol] = kind


def layer_kind(symbol: str) -> LayerKind:
    """The registered kind of ``symbol``.

    Raises:
        ValueError: no kind is registered for it.
    """
    try:
        return LAYER_KINDS[symbol]
    except KeyError:
        raise ValueError(
            f"no layer kind is registered for symbol {symbol!r}; registered: "
            f"{', '.join(sorted(LAYER_KINDS))}"
        ) from None


_attention = _transformer_layer_builder(attention=True)
_mlp = _transformer_layer_builder(attention=False)
for _kind in (
    LayerKind(MAMBA, "Mamba", "mamba_layer", _build_mamba, _forward_mamba_layer),
    LayerKind(GDN, "GatedDeltaNet", "gdn_layer", _mlp, _forward_transformer_layer),
    LayerKind(ATTENTION, "attention", "attention_layer", _attention, _forward_transformer_layer),
    LayerKind(
        DSA, "DeepSeek sparse attention", "dsa_layer", _attention, _forward_transformer_layer
    ),
    LayerKind(MLA, "multi-latent attention", "mla_layer", _attention, _forward_transformer_layer),
    LayerKind(MLP, "dense MLP", "mlp_layer", _mlp, _forward_transformer_layer),
    LayerKind(MOE, "MoE", "moe_layer", _mlp, _forward_transformer_layer),
):
    register_layer_kind(_kind)

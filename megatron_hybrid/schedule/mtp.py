"""Combined-1F1B callables of a multi-token-prediction (MTP) depth.

An MTP depth is a fused unit: embed the shifted tokens, norm and project them together with the
decoder's hidden states, run the depth's inner layers (its pattern, e.g. ``*E``, scheduled like
any logical layer) and norm the result. Two details differ from megatron-core 0.19.2's MTP
callables, each fixing an upstream bug class:

* the chunks of the decoder output kept for the post-process concatenation are ``node.detach``-ed,
  so their graph is traversed by exactly one backward (upstream carried live chunks across slots
  and ran backward through them twice);
* when this model chunk holds no decoder layer (an empty last virtual stage before MTP), the
  decoder's final norm is applied here, before chunking — nothing else would apply it.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.multi_token_prediction import get_mtp_layer_offset
from megatron.core.utils import make_viewless_tensor

from megatron_hybrid.modules.hybrid_stack import sequence_parallel_rng_context
from megatron_hybrid.schedule.callables import (
    LayerCallables,
    UnschedulableLayerError,
    build_layer_callables,
)

__all__ = ["build_mtp_callables"]


def build_mtp_callables(mtp_layer) -> LayerCallables:
    """Slot callables of one ``MultiTokenPredictionLayer`` whose inner stack ends in MoE.

    Raises:
        UnschedulableLayerError: the MTP pattern does not end in ``E``.
    """
    inner = mtp_layer.mtp_model_layer
    members = list(zip(inner.layer_type_list, inner.layers, strict=True))
    callables = build_layer_callables(members)
    if not callables.is_moe:
        raise UnschedulableLayerError(
            "EP overlap schedules an MTP depth only when its pattern ends in MoE ('E'), e.g. "
            "'/*E'; change the MTP part of the pattern or turn the overlap off"
        )
    config = mtp_layer.config
    inner_pre_dispatch, dispatch, experts, combine, _ = callables.forward

    def pre_dispatch(node, hidden_states):
        state = node.chunk_state
        if node.is_first_layer:
            model = state.model
            final_norm = model.decoder.final_layernorm
            if len(model.decoder.layers) == 0 and final_norm is not None:
                hidden_states = make_viewless_tensor(
                    inp=final_norm(hidden_states), requires_grad=True, keep_graph=True
                )
            offset = get_mtp_layer_offset(config, model.vp_stage)
            chunks = torch.chunk(hidden_states, 1 + offset, dim=0)
            state.mtp_hidden_states = [node.detach(chunk) for chunk in chunks]
            hidden_states = chunks[offset]
        input_ids, position_ids, padding_mask, decoder_input, hidden_states = (
            mtp_layer._get_embeddings(
                input_ids=state.input_ids,
                position_ids=state.position_ids,
                embedding=state.model.embedding,
                hidden_states=hidden_states,
                packed_seq_params=state.packed_seq_params,
                padding_mask=state.padding_mask,
            )
        )
        state.input_ids, state.position_ids, state.padding_mask = (
            input_ids,
            position_ids,
            padding_mask,
        )
        with sequence_parallel_rng_context(config):
            hidden_states = mtp_layer._concat_embeddings(hidden_states, decoder_input)
            return inner_pre_dispatch(node, hidden_states)

    def with_rng(function):
        def wrapped(node, *args):
            with sequence_parallel_rng_context(config):
                return function(node, *args)

        return wrapped

    def post_process(node, hidden_states):
        hidden_states = mtp_layer._postprocess(hidden_states)
        node.chunk_state.mtp_hidden_states.append(hidden_states)
        if node.is_last_layer:
            hidden_states = torch.cat(node.chunk_state.mtp_hidden_states, dim=0)
            node.chunk_state.mtp_hidden_states = None
        return hidden_states

    callables.forward = [
        pre_dispatch,
        with_rng(dispatch),
        with_rng(experts),
        with_rng(combine),
        post_process,
    ]
    callables.backward_dw["pre_dispatch_computation"].append(mtp_layer.eh_proj)
    return callables

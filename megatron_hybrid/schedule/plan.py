"""Combined-1F1B schedule plan of a HybridModel chunk, on megatron-core's common plan base.

megatron-core 0.19.2 ships the model-agnostic plan (``TransformerModelChunkSchedulePlan``: pre-
and post-process nodes, the layer-by-layer 1F1B interleaving) with hooks for other models: the
per-layer plan class and per-layer extra arguments. This module plugs in a layer plan that builds
its slot callables from :mod:`megatron_hybrid.schedule.callables` — one plan per *logical*
layer, so a group ``[GE]`` is one overlapped unit — and validates a model up front, so that
whatever cannot be scheduled fails when the model or plan is built, not mid-step.
"""

from __future__ import annotations

from contextlib import nullcontext

from megatron.core.models.common.model_chunk_schedule_plan import (
    TransformerLayerSchedulePlan,
    TransformerModelChunkSchedulePlan,
)
from megatron.core.models.common.utils import TransformerLayerNode
from megatron.core.pipeline_parallel.utils import NoopScheduleNode
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

from megatron_hybrid.modules.hybrid_stack import HybridStack
from megatron_hybrid.schedule.callables import (
    LayerCallables,
    UnschedulableLayerError,
    build_layer_callables,
)
from megatron_hybrid.schedule.mtp import build_mtp_callables

__all__ = [
    "HybridLayerSchedulePlan",
    "HybridModelChunkSchedulePlan",
    "build_hybrid_schedule_plan",
    "check_schedulable",
    "logical_layer_members",
]

_SLOTS = ("pre_dispatch_computation", "moe_dispatch", "mlp", "moe_combine", "mtp_post_process")


def logical_layer_members(layer, layer_type) -> list:
    """``[(symbol, module)]`` of one logical layer of a decoder (a group or a single layer)."""
    if isinstance(layer_type, tuple):
        return list(zip(layer_type, layer.layers, strict=True))
    return [(layer_type, layer)]


def _callables_for(layer, layer_type) -> LayerCallables:
    if isinstance(layer, MultiTokenPredictionLayer):
        return build_mtp_callables(layer)
    return build_layer_callables(logical_layer_members(layer, layer_type))


class HybridLayerSchedulePlan(TransformerLayerSchedulePlan):
    """The five schedule nodes of one logical layer (a group, a single layer, or an MTP depth)."""

    def _build_callable_nodes(self, event, comp_stream, comm_stream, extra_args):
        layer_type = extra_args.pop("layer_type", None)
        callables = _callables_for(self.layer, layer_type)
        self.is_mtp = isinstance(self.layer, MultiTokenPredictionLayer)
        extra_args.update(
            config=self.layer.config,
            is_moe=callables.is_moe,
            num_local_experts=callables.num_local_experts,
            delay_wgrad_compute=self.layer.config.delay_wgrad_compute,
            is_mtp=self.is_mtp,
        )

        def node(stream, function, name):
            dw = callables.backward_dw.get(name)
            node_args = dict(extra_args)
            if not dw:
                # A slot without delayed-wgrad work computes its wgrad in backward() (so a
                # post-backward hook fires there, not in an empty backward_dw()).
                node_args["delay_wgrad_compute"] = False
            return TransformerLayerNode(
                stream,
                event,
                self.layer_state,
                self.chunk_state,
                function,
                name=name,
                bwd_dw_callables=dw or None,
                extra_args=node_args,
            )

        pre_dispatch, dispatch, mlp, combine, post = callables.forward
        self.pre_dispatch_computation = node(comp_stream, pre_dispatch, _SLOTS[0])
        self.mlp = node(comp_stream, mlp, _SLOTS[2])
        if callables.is_moe:
            self.moe_dispatch = node(comm_stream, dispatch, _SLOTS[1])
            self.moe_combine = node(comm_stream, combine, _SLOTS[3])
        else:
            self.moe_dispatch = NoopScheduleNode()
            self.moe_combine = NoopScheduleNode()
        self.mtp_post_process = (
            node(comp_stream, post, _SLOTS[4]) if post is not None else NoopScheduleNode()
        )

    def get_low_precision_context(self):
        """Decoder entries apply per-physical-layer FP8/FP4 contexts inside their callables."""
        if self.is_mtp:
            return self.layer.get_inner_quantization_context()
        return nullcontext()

    def set_fsdp_reshard_hooks(self, post_forward_hook, post_backward_hook):
        """Release a logical layer's all-gathered parameters after its last slot (FSDP)."""
        module = self.layer.mtp_model_layer if self.is_mtp else self.layer
        self.pre_dispatch_computation.set_post_backward_hook(lambda: post_backward_hook(module))
        last = self.mlp if isinstance(self.moe_combine, NoopScheduleNode) else self.moe_combine
        last.set_post_forward_hook(lambda: post_forward_hook(module))


class HybridModelChunkSchedulePlan(TransformerModelChunkSchedulePlan):
    """Plan of one HybridModel chunk: pre-process, one plan per logical layer, MTP, post-process."""

    LAYER_SCHEDULE_PLAN_CLASS = HybridLayerSchedulePlan

    def _extra_args_for_layer(self, module, layer_idx, num_layers):
        extra = super()._extra_args_for_layer(module, layer_idx, num_layers)
        if isinstance(module, HybridStack):
            extra["layer_type"] = module.layer_type_list[layer_idx]
        return extra


def check_schedulable(model) -> None:
    """Raise now if the model cannot run under the combined-1F1B EP-overlap schedule.

    Raises:
        ValueError: what cannot be scheduled and what to change.
    """
    config = model.config
    if config.cuda_graph_impl != "none":
        raise ValueError(
            "EP overlap with HybridModel does not support megatron-core's CUDA graphs "
            f"(cuda_graph_impl={config.cuda_graph_impl!r}); set cuda_graph_impl='none' and "
            "build the model with HybridModel(..., hybrid_cuda_graphs=True) for the package's "
            "own graphs, which both schedules replay"
        )
    decoder = model.decoder
    for index, (item, layer) in enumerate(
        zip(decoder.layer_type_list, decoder.layers, strict=True)
    ):
        try:
            build_layer_callables(logical_layer_members(layer, item))
        except UnschedulableLayerError as error:
            logical = decoder.logical_layer_offset + index
            raise UnschedulableLayerError(f"logical layer {logical} ({item!r}): {error}") from None
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        for depth in mtp.layers:
            build_mtp_callables(depth)


def build_hybrid_schedule_plan(model, input_ids, position_ids, attention_mask, **kwargs):
    """``HybridModel.build_schedule_plan``: validate the inputs, then build the chunk plan."""
    if not model.config.overlap_moe_expert_parallel_comm:
        raise ValueError(
            "build_schedule_plan is for the EP-overlap schedule; set "
            "overlap_moe_expert_parallel_comm=True in the TransformerConfig"
        )
    packed = kwargs.get("packed_seq_params")
    if packed is not None and getattr(packed, "tokens_per_sample", None) is not None:
        raise ValueError(
            "EP overlap does not support packed batches flattened across samples "
            "(packed_seq_params.tokens_per_sample); pack one sample per micro-batch row"
        )
    return HybridModelChunkSchedulePlan(
        model,
        input_ids,
        position_ids,
        attention_mask,
        kwargs.get("decoder_input"),
        kwargs.get("labels"),
        packed,
        kwargs.get("extra_block_kwargs"),
        kwargs.get("runtime_gather_output"),
        kwargs.get("loss_mask"),
        kwargs.get("padding_mask"),
        output_processor=kwargs.get("output_processor"),
        output_processor_context=kwargs.get("output_processor_context"),
    )

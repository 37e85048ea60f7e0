"""HybridStack: a stack of hybrid layers in which a bracketed group is one logical layer.

``layers[i]`` is logical layer ``logical_layer_offset + i``: a plain layer, or for a group such
as ``[*E]`` a nested ``HybridStack`` (no embedding, no final norm) holding the group's physical
layers. Vocabulary: a *physical* layer is one pattern symbol (what ``TransformerConfig.num_layers``
counts, what ``layer_number`` and per-layer FP8/FP4 recipes index); a *logical* layer is a
top-level item (what recompute, the EP-overlap plan and checkpoint keys of grouped patterns
count).

A pattern without groups builds the layers megatron-core's HybridStack builds, with the same
layer numbers and checkpoint keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

from megatron.core import tensor_parallel
from megatron.core.enums import Fp8Recipe
from megatron.core.fp4_utils import get_fp4_context
from megatron.core.fp8_utils import get_fp8_context
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import WrappedTensor, deprecate_inference_params, make_viewless_tensor
from torch import Tensor, nn

from megatron_hybrid.checkpointing.sharded import CheckpointKeyLayout, stack_sharded_state_dict
from megatron_hybrid.modules.layer_types.common import layer_quant_context
from megatron_hybrid.modules.registry import LayerBuildArgs, LayerInputs, layer_runtime
from megatron_hybrid.pattern import item_physical_count

__all__ = ["HybridStack", "layer_spec", "sequence_parallel_rng_context"]


def layer_spec(submodules, spec_field: str, symbol: str):
    """The spec of a layer type: a ``HybridStackSubmodules`` field, or a registered type's entry
    in its ``extra_layers``.

    Raises:
        ValueError: the spec has neither (a spec built before the type was registered).
    """
    spec = getattr(submodules, spec_field, None)
    if spec is None:
        spec = (getattr(submodules, "extra_layers", None) or {}).get(spec_field)
    if spec is None:
        raise ValueError(
            f"the stack spec has no {spec_field!r} for layer symbol {symbol!r}; build the spec "
            "with hybrid_stack_spec(...) after registering the layer type"
        )
    return spec


def _init_quant_context(config, physical_index: int):
    if config.fp8:
        return get_fp8_context(config, physical_index, is_init=True)
    if config.fp4:
        return get_fp4_context(config, physical_index, is_init=True)
    return nullcontext()


def sequence_parallel_rng_context(config):
    """The model-parallel RNG under sequence parallelism (dropout of SP-sharded activations)."""
    if config.sequence_parallel:
        return tensor_parallel.get_cuda_rng_tracker().fork()
    return nullcontext()


class HybridStack(MegatronModule):
    """A hybrid layer stack; same constructor as megatron-core's HybridStack plus grouping.

    Args:
        config: model config; ``num_layers`` counts physical layers.
        submodules: :class:`~megatron_hybrid.modules.specs.HybridStackSubmodules`.
        pre_process: whether this stack receives ``hidden_states`` directly (False: from the
            previous pipeline stage through ``set_input_tensor``).
        layer_type_list: items of this stack: a symbol (``"*"``) or a group (``("*", "E")``).
        pp_layer_offset: physical index of this stack's first layer.
        post_layer_norm: whether to apply the final norm (with ``post_process``).
        post_process: whether this is the last stage.
        device: unused; kept for megatron-core's signature.
        dtype: unused; kept for megatron-core's signature.
        pg_collection: process groups.
        is_mtp_layer: whether this stack is an MTP depth.
        name: module instance name, passed down to layers.
        logical_layer_offset: logical index of this stack's first item.
        is_layer_group: True for the nested stack of one group.
        stage_offset: physical offset of the pipeline stage (defaults to ``pp_layer_offset``);
            groups pass the stage's, so inner layers index inference caches by stage position.
        checkpoint_keys: how sharded keys are formed (None: megatron-core's physical keys).
    """

    def __init__(
        self,
        config,
        submodules,
        pre_process: bool = True,
        layer_type_list: Sequence | None = None,
        pp_layer_offset: int = 0,
        post_layer_norm: bool = True,
        post_process: bool = True,
        device=None,
        dtype=None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: str | None = None,
        *,
        logical_layer_offset: int = 0,
        is_layer_group: bool = False,
        stage_offset: int | None = None,
        checkpoint_keys: CheckpointKeyLayout | None = None,
    ) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            raise ValueError("HybridStack needs pg_collection (a ProcessGroupCollection)")
        if layer_type_list is None:
            raise ValueError(
                "HybridStack needs layer_type_list: the items of this stack, e.g. from "
                "megatron_hybrid.pattern.select_pipeline_segment(...).items"
            )
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.is_mtp_layer = is_mtp_layer
        self.is_layer_group = is_layer_group
        self.pg_collection = pg_collection
        self.pp_group = pg_collection.pp
        self.tp_group = pg_collection.tp
        self.input_tensor = None
        self.layer_type_list = [
            item if isinstance(item, str) else tuple(item) for item in layer_type_list
        ]
        self.pp_layer_offset = pp_layer_offset
        self.logical_layer_offset = logical_layer_offset
        self.checkpoint_keys = checkpoint_keys
        stage_offset = pp_layer_offset if stage_offset is None else stage_offset

        self.layers = nn.ModuleList()
        physical = pp_layer_offset
        for i, item in enumerate(self.layer_type_list):
            layer_name = f"{name}.layers.{i}" if name is not None else None
            if isinstance(item, tuple):
                if is_layer_group:
                    raise ValueError(
                        f"a layer group cannot contain another group (got {item!r} inside a "
                        "group); flatten it into one group"
                    )
                layer = HybridStack(
                    config,
                    submodules,
                    pre_process=True,
                    layer_type_list=item,
                    pp_layer_offset=physical,
                    post_layer_norm=False,
                    post_process=False,
                    pg_collection=pg_collection,
                    is_mtp_layer=is_mtp_layer,
                    name=layer_name,
                    logical_layer_offset=logical_layer_offset + i,
                    is_layer_group=True,
                    stage_offset=stage_offset,
                )
            else:
                runtime = layer_runtime(item)
                spec = layer_spec(submodules, runtime.spec_field, item)
                args = LayerBuildArgs(
                    config=config,
                    pg_collection=pg_collection,
                    layer_number=physical + 1,
                    stage_offset=stage_offset,
                    is_mtp_layer=is_mtp_layer,
                    name=layer_name,
                )
                with _init_quant_context(config, physical):
                    layer = runtime.build(spec, args)
            self.layers.append(layer)
            physical += item_physical_count(item)

        # Full recompute (uniform/block) counts logical layers, like TransformerBlock counts
        # GPT layers.
        self.num_layers_per_pipeline_rank = len(self.layers)

        if post_process and post_layer_norm and not is_layer_group:
            self.final_norm = submodules.final_norm(
                config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )

    @property
    def layer_number(self) -> int:
        """Physical, 1-based number of this stack's first layer (groups are called like layers)."""
        return self.pp_layer_offset + 1

    @property
    def final_layernorm(self):
        """The final norm under GPT's attribute name (schedule plans look it up there)."""
        return getattr(self, "final_norm", None)

    def set_input_tensor(self, input_tensor: Tensor) -> None:
        """Hidden states from the previous pipeline stage (see megatron's TransformerBlock)."""
        self.input_tensor = input_tensor

    def mamba_state_shapes_per_request(self):
        """Conv and SSM state shapes of the first Mamba layer of this stack, or None."""
        for layer in self.layers:
            # Groups and Mamba layers answer; other layer types keep no such state.
            shapes_of = getattr(layer, "mamba_state_shapes_per_request", None)
            shapes = shapes_of() if shapes_of is not None else None
            if shapes is not None:
                return shapes
        return None

    def iter_physical_layers(self):
        """Yield ``(symbol, layer)`` for every physical layer in order, groups flattened."""
        for item, layer in zip(self.layer_type_list, self.layers, strict=True):
            if isinstance(item, tuple):
                yield from layer.iter_physical_layers()
            else:
                yield item, layer

    def _run_layer(self, index: int, hidden_states: Tensor, inputs: LayerInputs) -> Tensor:
        item, layer = self.layer_type_list[index], self.layers[index]
        if isinstance(item, tuple):
            return layer._run_layers(0, len(layer.layers), hidden_states, inputs)
        with layer_quant_context(self.config, layer.layer_number - 1):
            hidden_states = layer_runtime(item).forward(layer, hidden_states, inputs)
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        return hidden_states

    def _run_layers(self, start: int, end: int, hidden_states: Tensor, inputs: LayerInputs):
        for index in range(start, end):
            hidden_states = self._run_layer(index, hidden_states, inputs)
        return hidden_states

    def _checkpointed_forward(self, hidden_states: Tensor, inputs: LayerInputs) -> Tensor:
        """Full activation recompute over logical layers (``uniform`` or ``block``)."""
        config = self.config

        def run_chunk(start: int, end: int, use_checkpoint: bool, hidden_states: Tensor):
            def chunk(hidden_states):
                return self._run_layers(start, end, hidden_states, inputs)

            if not use_checkpoint:
                return chunk(hidden_states)
            if config.fp8 or config.fp4:
                from megatron.core.extensions.transformer_engine import te_checkpoint

                return te_checkpoint(
                    chunk,
                    config.distribute_saved_activations,
                    tensor_parallel.random.get_cuda_rng_tracker,
                    self.tp_group,
                    hidden_states,
                )
            return tensor_parallel.checkpoint(
                chunk, config.distribute_saved_activations, hidden_states
            )

        num = self.num_layers_per_pipeline_rank
        if config.recompute_method == "uniform":
            for start in range(0, num, config.recompute_num_layers):
                end = min(start + config.recompute_num_layers, num)
                hidden_states = run_chunk(start, end, True, hidden_states)
        elif config.recompute_method == "block":
            skipped = 0
            for index in range(num):
                # The reentrant checkpoint needs an input that requires grad; under FP8/FP4 the
                # first layers may see one that does not, so the window moves past them.
                if (config.fp8 or config.fp4) and not hidden_states.requires_grad:
                    skipped += 1
                use = skipped <= index < config.recompute_num_layers + skipped
                hidden_states = run_chunk(index, index + 1, use, hidden_states)
        else:
            raise ValueError(
                f"recompute_method={config.recompute_method!r} is not supported with "
                "recompute_granularity='full'; use 'uniform' or 'block'"
            )
        return hidden_states

    def forward(
        self,
        hidden_states: Tensor | WrappedTensor | None,
        attention_mask: Tensor | None,
        inference_context=None,
        rotary_pos_emb=None,
        *,
        inference_params=None,
        packed_seq_params=None,
        padding_mask: Tensor | None = None,
        rotary_pos_cos: Tensor | None = None,
        rotary_pos_sin: Tensor | None = None,
        rotary_pos_cos_sin: Tensor | None = None,
        sequence_len_offset: Tensor | None = None,
        **unused_block_kwargs,
    ) -> Tensor:
        """Run the stack like megatron's TransformerBlock/HybridStack.

        Args:
            hidden_states: ``[s, b, h]`` input (ignored without ``pre_process``).
            attention_mask: attention mask.
            inference_context: inference context.
            rotary_pos_emb: rotary embeddings.
            inference_params: deprecated alias of ``inference_context``.
            packed_seq_params: THD packing metadata.
            padding_mask: ``[b, s]``, True = padding (excluded from MoE routing).
            rotary_pos_cos: precomputed cos (flash decoding).
            rotary_pos_sin: precomputed sin (flash decoding).
            rotary_pos_cos_sin: fused cos/sin (flashinfer).
            sequence_len_offset: inference offsets.
            **unused_block_kwargs: TransformerBlock arguments a hybrid stack does not use
                (``context``, ``context_mask``, ``attention_bias``); accepted so callers can
                treat both alike.

        Returns:
            The output hidden states ``[s, b, h]``.
        """
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if not self.pre_process:
            hidden_states = self.input_tensor
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        inputs = LayerInputs(
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            sequence_len_offset=sequence_len_offset,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        if self.is_layer_group:
            # A group called on its own (not through its parent stack): plain layer loop.
            return self._run_layers(0, len(self.layers), hidden_states, inputs)

        config = self.config
        # As in TransformerBlock: dropout under sequence parallelism draws from the
        # model-parallel RNG, and the delayed FP8 recipe wraps the whole pass.
        rng_context = sequence_parallel_rng_context(config)
        outer_quant_context = (
            get_fp8_context(config)
            if config.fp8 and config.fp8_recipe == Fp8Recipe.delayed
            else nullcontext()
        )
        with rng_context, outer_quant_context:
            if config.recompute_granularity == "full" and self.training:
                hidden_states = self._checkpointed_forward(hidden_states, inputs)
            else:
                hidden_states = self._run_layers(0, len(self.layers), hidden_states, inputs)

        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        elif not self.pre_process and len(self.layers) == 0:
            # An empty intermediate stage must not hand its input tensor on as its output.
            hidden_states = hidden_states.clone()
        return make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ):
        """Sharded state dict; keys as described in ``docs/checkpoints.md``."""
        return stack_sharded_state_dict(self, prefix, sharded_offsets, metadata)

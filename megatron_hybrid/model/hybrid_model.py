"""HybridModel: megatron-core's HybridModel constructor, the full pattern grammar.

The model's embedding, rotary embedding, MTP block and output layer are megatron-core's; the
decoder is :class:`~megatron_hybrid.HybridStack`. The forward pass is GPTModel's
``_preprocess`` / decoder / ``_postprocess`` split — GPTModel's own methods, so a grouped model
computes what GPTModel computes (sequence-parallel ``padding_mask`` scatter included) and the
combined-1F1B schedule plan can call the two halves as nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.quantization.utils import get_quant_config_or_none
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import deprecate_inference_params
from torch import Tensor

from megatron_hybrid.checkpointing.sharded import CheckpointKeyLayout, gpt_mtp_keys
from megatron_hybrid.kernels.cross_entropy import cross_entropy_reason, vocab_parallel_cross_entropy
from megatron_hybrid.model.arguments import check_config, check_real_vocab_size, resolve_pattern
from megatron_hybrid.padding.fixed import rope_table_params
from megatron_hybrid.pattern import (
    ParsedPattern,
    parse_pattern,
    select_pipeline_segment,
)
from megatron_hybrid.schedule.graphs import enable_cuda_graphs
from megatron_hybrid.schedule.plan import build_hybrid_schedule_plan, check_schedulable

__all__ = ["HybridModel"]


class HybridModel(LanguageModule):
    """Hybrid language model; a drop-in for megatron-core 0.19.2's ``HybridModel``.

    Args:
        config: model config; ``num_layers`` = physical layers of the main pattern,
            ``mtp_num_layers`` = MTP depths.
        hybrid_stack_spec: from :func:`~megatron_hybrid.hybrid_stack_spec`.
        vocab_size: vocabulary size.
        max_sequence_length: maximum sequence length (positional embeddings).
        hybrid_layer_pattern: the pattern, e.g. ``"[*-]{3}[*E]{58}/*E"``, or its parse
            (:class:`~megatron_hybrid.pattern.ParsedPattern`, used as is).
        hybrid_attention_ratio: deprecated (megatron-core); builds a pattern from ratios.
        hybrid_mlp_ratio: deprecated (megatron-core); builds a pattern from ratios.
        hybrid_override_pattern: deprecated alias of ``hybrid_layer_pattern``.
        pre_process: build the embedding (first pipeline stage).
        post_process: build the output layer (last pipeline stage).
        fp16_lm_cross_entropy: compute the LM loss in fp16.
        parallel_output: keep logits split over tensor-parallel ranks.
        share_embeddings_and_output_weights: tie embedding and output weights.
        position_embedding_type: ``learned_absolute``, ``rope``, ``yarn`` or ``none``.
        rotary_percent: fraction of the head dimension that gets rotary embeddings.
        rotary_base: rotary base period.
        scatter_embedding_sequence_parallel: scatter embeddings for sequence parallelism.
        seq_len_interpolation_factor: linear RoPE interpolation factor.
        pg_collection: process groups (megatron's ``ProcessGroupCollection``).
        vp_stage: virtual pipeline stage of this model chunk.
        hybrid_cuda_graphs: capture the compute pieces of every layer (token mixers, dense
            MLPs, MoE routers and shared experts) as CUDA graphs, replayed in the plain schedule
            and the EP-overlap plan alike; ``self.hybrid_cuda_graphs`` then reports what is graphed
            and what stays eager (``docs/ep_overlap.md``, "CUDA graphs").
        real_vocab_size: the tokenizer's vocabulary when ``vocab_size`` is padded
            (Megatron-LM pads it to a multiple of ``make_vocab_size_divisible_by`` x TP); kept
            as ``self.real_vocab_size`` (default: ``vocab_size``), so that log-probs leave the
            padding rows out of the softmax and checkpoints record it.
    """

    def __init__(
        self,
        config,
        hybrid_stack_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        hybrid_layer_pattern: str | ParsedPattern | None = None,
        hybrid_attention_ratio: float | None = None,
        hybrid_mlp_ratio: float | None = None,
        hybrid_override_pattern: str | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = "none",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: float | None = None,
        pg_collection=None,
        vp_stage: int | None = None,
        *,
        hybrid_cuda_graphs: bool = False,
        real_vocab_size: int | None = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        pattern = resolve_pattern(
            config,
            hybrid_layer_pattern,
            hybrid_attention_ratio,
            hybrid_mlp_ratio,
            hybrid_override_pattern,
        )
        parsed = parse_pattern(pattern)
        pp_group = self.pg_collection.pp
        pp_size, pp_rank = pp_group.size(), pp_group.rank()
        check_config(config, parsed, hybrid_stack_spec, pp_size, vp_stage)

        self.hybrid_stack_spec = hybrid_stack_spec
        self.hybrid_layer_pattern = parsed.pattern
        self.parsed_pattern = parsed
        self.vocab_size = vocab_size
        self.real_vocab_size = check_real_vocab_size(real_vocab_size, vocab_size)
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.vp_stage = vp_stage
        self.disable_param_offloading = True
        self.model_type = ModelType.encoder_or_decoder
        self.rotary_pos_emb_cache = {}
        self.mtp_pattern = parsed.mtp_pattern
        self.mtp_num_depths = parsed.mtp_num_depths

        self.pipeline_selection = select_pipeline_segment(
            parsed,
            pp_rank=pp_rank,
            pp_size=pp_size,
            vp_stage=vp_stage,
            first_stage_layers=config.num_layers_in_first_pipeline_stage,
            last_stage_layers=config.num_layers_in_last_pipeline_stage,
        )
        vpp = config.virtual_pipeline_model_parallel_size or 1
        is_last_chunk = pp_rank == pp_size - 1 and (vp_stage is None or vp_stage == vpp - 1)
        # MTP lives on the last pipeline stage, as in megatron-core's HybridModel.
        self.mtp_process = parsed.mtp_num_depths > 0 and is_last_chunk

        if self.pre_process or self.mtp_process:
            self._build_embedding(scatter_embedding_sequence_parallel)
        self._build_rotary(rotary_percent, rotary_base, seq_len_interpolation_factor)
        self._build_decoder()
        if self.mtp_process:
            self._build_mtp()
        if post_process or self.mtp_process:
            self._build_output_layer()
        if pre_process or post_process or self.mtp_process:
            self.setup_embeddings_and_output_layer()
        for name, module in self.named_modules():
            if hasattr(module, "finish_init"):
                module.finish_init(get_quant_config_or_none(name, config.quant_recipe))
        if config.overlap_moe_expert_parallel_comm:
            # Refuse now what the EP-overlap schedule cannot run, not in the first step.
            check_schedulable(self)
        self.hybrid_cuda_graphs = None  # enable_cuda_graphs sets its report here
        if hybrid_cuda_graphs:
            enable_cuda_graphs(self)

    def _build_embedding(self, scatter_to_sequence_parallel: bool) -> None:
        """megatron-core's word (and position) embedding, on the first stage and for MTP."""
        self.embedding = LanguageModelEmbedding(
            config=self.config,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            position_embedding_type=self.position_embedding_type,
            scatter_to_sequence_parallel=scatter_to_sequence_parallel,
            tp_group=self.pg_collection.tp,
        )

    def _build_decoder(self) -> None:
        """The decoder: a HybridStack over this pipeline chunk's logical layers."""
        selection = self.pipeline_selection
        self.decoder = build_module(
            self.hybrid_stack_spec,
            self.config,
            pre_process=self.pre_process,
            layer_type_list=selection.items,
            pp_layer_offset=selection.physical_offset,
            post_process=self.post_process,
            dtype=self.config.params_dtype,
            pg_collection=self.pg_collection,
            name="decoder",
            logical_layer_offset=selection.logical_offset,
            checkpoint_keys=CheckpointKeyLayout.for_pattern(self.parsed_pattern),
        )

    def _build_mtp(self) -> None:
        """megatron-core's MTP block over the pattern's MTP part (last pipeline chunk only)."""
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

        submodules = self.hybrid_stack_spec.submodules
        self.mtp = MultiTokenPredictionBlock(
            config=self.config,
            spec=submodules.mtp_block_spec,
            pg_collection=self.pg_collection,
            vp_stage=self.vp_stage,
            mtp_layer_pattern=self.parsed_pattern.mtp_pattern,
            mtp_num_depths=self.parsed_pattern.mtp_num_depths,
            hybrid_submodules=submodules,
            name="mtp",
        )

    def _build_output_layer(self) -> None:
        """The vocabulary projection (GPTModel's, weight shared with the embedding if tied)."""
        config, tied = self.config, self.share_embeddings_and_output_weights
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            self.vocab_size,
            config=config,
            init_method=(
                config.embedding_init_method if config.use_mup and not tied else config.init_method
            ),
            bias=False,
            skip_bias_add=False,
            gather_output=not self.parallel_output,
            skip_weight_param_allocation=self.pre_process and tied,
            tp_group=self.pg_collection.tp,
        )

    def _build_rotary(self, rotary_percent, rotary_base, seq_len_interpolation_factor) -> None:
        config = self.config
        common = dict(
            kv_channels=config.kv_channels,
            rotary_percent=rotary_percent,
            rotary_interleaved=config.rotary_interleaved,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            rotary_base=rotary_base,
            use_cpu_initialization=config.use_cpu_initialization,
            cp_group=self.pg_collection.cp,
        )
        # MLA and DSA carry their own decoupled RoPE.
        if self.position_embedding_type == "rope" and not config.multi_latent_attention:
            self.rotary_pos_emb = RotaryEmbedding(**common)
        elif self.position_embedding_type == "yarn":
            self.rotary_pos_emb = YarnRotaryEmbedding(
                **common,
                scaling_factor=config.yarn_rotary_scaling_factor,
                original_max_position_embeddings=config.yarn_original_max_position_embeddings,
                beta_fast=config.yarn_beta_fast,
                beta_slow=config.yarn_beta_slow,
                mscale=config.yarn_mscale,
                mscale_all_dim=config.yarn_mscale_all_dim,
                correction_range_round_to_int=config.yarn_correction_range_round_to_int,
            )

    # GPTModel's halves of the forward pass; they only use attributes this model has too.
    _postprocess = GPTModel._postprocess
    preprocess_for_fine_grained_offloading = GPTModel.preprocess_for_fine_grained_offloading
    preprocess_for_paged_stash = GPTModel.preprocess_for_paged_stash

    def _preprocess(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        decoder_input: Tensor | None = None,
        inference_context=None,
        packed_seq_params=None,
        padding_mask: Tensor | None = None,
    ):
        """GPTModel's ``_preprocess``; with the package's CUDA graphs, packed rows get a rotary
        table per row length, not per longest sequence, so that graphed pieces replay one shape
        (``padding/fixed.py``). Both schedules call it: ``forward`` and the EP-overlap plan's
        pre-process node (megatron-core 0.19.2 ``models/common/utils.py``, ``PreProcessNode``),
        which passes the micro-batch's own boundaries."""
        if self.hybrid_cuda_graphs is not None:
            packed_seq_params = rope_table_params(packed_seq_params)
        return GPTModel._preprocess(
            self, input_ids, position_ids, decoder_input=decoder_input,
            inference_context=inference_context, packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )  # fmt: skip

    def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
        """megatron's loss (``LanguageModule.compute_language_model_loss``, MTP's too), with its
        fused ``native`` cross entropy as two Triton passes where they apply
        (:mod:`~megatron_hybrid.kernels.cross_entropy`); ``self.cross_entropy_path`` says which
        ran last."""
        config = self.config
        if not config.cross_entropy_loss_fusion:
            reason = "cross_entropy_loss_fusion is off"
        elif config.cross_entropy_fusion_impl != "native":
            reason = f"cross_entropy_fusion_impl={config.cross_entropy_fusion_impl!r}"
        else:
            reason = cross_entropy_reason(logits)
        self.cross_entropy_path = "Triton" if reason is None else f"megatron's ({reason})"
        if reason is None:  # [b, s] labels, [s, b] logits and loss, as megatron's
            loss = vocab_parallel_cross_entropy(logits, labels.t(), self.pg_collection.tp)
            return loss.t().contiguous()
        return super().compute_language_model_loss(labels, logits)

    def _prepare_step(self) -> None:
        """Per-step hooks of activation offloading and the paged MoE stash, as GPTModel runs."""
        if self.config.fine_grained_activation_offloading:
            self.preprocess_for_fine_grained_offloading()
        if self.config.moe_paged_stash:
            self.preprocess_for_paged_stash()

    def set_input_tensor(self, input_tensor) -> None:
        """Input from the previous pipeline stage (a list of one tensor, as in GPTModel)."""
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        if len(input_tensor) != 1:
            raise ValueError(f"expected one input tensor, got {len(input_tensor)}")
        self.decoder.set_input_tensor(input_tensor[0])

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
        decoder_input: Tensor | None = None,
        labels: Tensor | None = None,
        inference_context=None,
        runtime_gather_output: bool | None = None,
        *,
        inference_params=None,
        loss_mask: Tensor | None = None,
        packed_seq_params=None,
        padding_mask: Tensor | None = None,
        extra_block_kwargs: dict | None = None,
        output_processor: Callable[..., Tensor] | None = None,
        output_processor_context: Any = None,
    ) -> Tensor:
        """Embedding, decoder, output layer; the loss when ``labels`` are given.

        Same arguments as megatron-core's ``HybridModel.forward`` (``padding_mask``: ``[b, s]``,
        True = padding), plus GPTModel's ``extra_block_kwargs`` and ``output_processor``.
        """
        self._prepare_step()
        inference_context = deprecate_inference_params(inference_context, inference_params)
        preprocessed = self._preprocess(
            input_ids=input_ids,
            position_ids=position_ids,
            decoder_input=decoder_input,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset = (
            preprocessed[:5]
        )
        padding_mask = preprocessed[5]
        rotary_pos_cos_sin = preprocessed[6] if len(preprocessed) == 7 else None
        hidden_states = self.decoder(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            padding_mask=padding_mask,
            **(extra_block_kwargs or {}),
        )
        return self._postprocess(
            hidden_states=hidden_states,
            input_ids=input_ids,
            position_ids=position_ids,
            labels=labels,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            mtp_in_postprocess=self.mtp_process,
            loss_mask=loss_mask,
            decoder_input=decoder_input,
            attention_mask=attention_mask,
            padding_mask=padding_mask,
            inference_params=inference_params,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            runtime_gather_output=runtime_gather_output,
            extra_block_kwargs=extra_block_kwargs,
            inference_context=inference_context,
            output_processor=output_processor,
            output_processor_context=output_processor_context,
        )

    def build_schedule_plan(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
        decoder_input: Tensor | None = None,
        labels: Tensor | None = None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs: dict | None = None,
        runtime_gather_output: bool | None = None,
        inference_params=None,
        loss_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
        *,
        output_processor: Callable[..., Tensor] | None = None,
        output_processor_context: Any = None,
    ):
        """Combined-1F1B schedule plan of this model chunk (GPTModel's signature).

        Used by megatron-core's schedules when ``overlap_moe_expert_parallel_comm`` is set; see
        ``docs/ep_overlap.md``.
        """
        self._prepare_step()
        return build_hybrid_schedule_plan(
            self,
            input_ids,
            position_ids,
            attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            packed_seq_params=packed_seq_params,
            extra_block_kwargs=extra_block_kwargs,
            runtime_gather_output=runtime_gather_output,
            loss_mask=loss_mask,
            padding_mask=padding_mask,
            output_processor=output_processor,
            output_processor_context=output_processor_context,
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Sharded state dict; like GPTModel, without ``output_layer._extra_state``."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        extra = sharded.pop(f"{prefix}output_layer._extra_state", None)
        if extra is not None and extra.data:
            raise RuntimeError(f"expected the output layer's extra state to be empty: {extra}")
        gpt_mtp_keys(sharded, prefix, self.parsed_pattern)
        return sharded

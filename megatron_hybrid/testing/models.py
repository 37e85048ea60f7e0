"""Small models for tests, benchmarks and the CPU demo: a grouped HybridModel and its GPT twin.

:func:`build_hybrid` and :func:`build_gpt_twin` build the two models that must share
checkpoints and numerics; :func:`small_config` is a config that runs in milliseconds on a CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_hybrid.model import HybridModel
from megatron_hybrid.model.gpt_interop import gpt_config_for_pattern, gpt_decoder_spec_for_pattern
from megatron_hybrid.modules import hybrid_stack_spec
from megatron_hybrid.pattern import parse_pattern
from megatron_hybrid.runtime.cpu import cpu_config_overrides

__all__ = ["build_gpt_twin", "build_hybrid", "model_inputs", "small_config"]


def small_config(pattern: str, **overrides: Any):
    """A small ``TransformerConfig`` for ``pattern`` (num_layers/mtp_num_layers from it).

    Fusions that need CUDA are off, dropout is 0 and initialisation happens on the CPU, so two
    models built from the same seed are bitwise identical.
    """
    from megatron.core.transformer import TransformerConfig

    parsed = parse_pattern(pattern)
    symbols = {symbol for symbol, count in parsed.layer_counts.items() if count}
    # CPU initialisation also on GPUs: the same seed then gives the same weights in any layout.
    kwargs: dict[str, Any] = dict(
        cpu_config_overrides(),
        deterministic_mode=False,
        num_layers=parsed.physical_layer_count,
        mtp_num_layers=parsed.mtp_num_depths or None,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        bf16=False,
        params_dtype=torch.float32,
    )
    if "E" in symbols:
        kwargs.update(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0,
        )
    if "M" in symbols:
        # train's defaults; megatron-core's (128/64/8) do not fit hidden size 64.
        kwargs.update(mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2)
    if "G" in symbols:
        # megatron's GatedDeltaNet accepts only SiLU; deterministic mode is its torch path (fla's
        # Triton kernels need a GPU, and their backward is refused on Hopper with Triton < 3.7.1).
        kwargs.update(
            activation_func=torch.nn.functional.silu,
            deterministic_mode=True,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _stage_flags(pg_collection, config, vp_stage) -> tuple[bool, bool]:
    """``(pre_process, post_process)`` of this rank's chunk ``vp_stage``."""
    pp = pg_collection.pp
    vpp = config.virtual_pipeline_model_parallel_size or 1
    first = pp.rank() == 0 and (vp_stage is None or vp_stage == 0)
    last = pp.rank() == pp.size() - 1 and (vp_stage is None or vp_stage == vpp - 1)
    return first, last


def build_hybrid(
    config,
    pattern: str,
    pg_collection,
    *,
    backend: str = "local",
    vocab_size: int = 128,
    max_sequence_length: int = 64,
    vp_stage: int | None = None,
    local_impl: str = "reference",
    **kwargs: Any,
):
    """A :class:`~megatron_hybrid.HybridModel` for ``pattern`` on this rank's pipeline stage.

    ``local_impl`` defaults to the ``local`` backend's reference modules, which
    :func:`build_gpt_twin`'s GPTModel also uses, so the twins compute alike on GPUs too; pass
    ``"fast"`` or ``"auto"`` for the fast path (:mod:`megatron_hybrid.modules.fast`).
    """
    first, last = _stage_flags(pg_collection, config, vp_stage)
    kwargs.setdefault("position_embedding_type", "rope")
    return HybridModel(
        config,
        hybrid_stack_spec(backend, config=config, local_impl=local_impl),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        hybrid_layer_pattern=pattern,
        pre_process=first,
        post_process=last,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
        **kwargs,
    )


def build_gpt_twin(
    config,
    pattern: str,
    pg_collection,
    *,
    backend: str = "local",
    vocab_size: int = 128,
    max_sequence_length: int = 64,
    vp_stage: int | None = None,
    **kwargs: Any,
):
    """The GPTModel that shares checkpoints (and math) with ``build_hybrid(config, pattern)``."""
    from megatron.core.models.gpt import GPTModel

    gpt_config = gpt_config_for_pattern(config, pattern)
    first, last = _stage_flags(pg_collection, gpt_config, vp_stage)
    kwargs.setdefault("position_embedding_type", "rope")
    spec = gpt_decoder_spec_for_pattern(gpt_config, pattern, backend, vp_stage)
    mtp_block_spec = None
    if gpt_config.mtp_num_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp_block_spec = get_gpt_mtp_block_spec(
            gpt_config, spec.layer_specs[-1], use_transformer_engine=backend == "te"
        )
    return GPTModel(
        gpt_config,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=first,
        post_process=last,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
        mtp_block_spec=mtp_block_spec,
        **kwargs,
    )


def model_inputs(batch: int = 2, seq: int = 16, vocab: int = 128, seed: int = 0) -> dict:
    """Deterministic token inputs with labels for a causal LM forward pass."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return dict(
        input_ids=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        position_ids=torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous(),
        attention_mask=None,
    )

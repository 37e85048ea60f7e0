"""Flag rules about the model's layers (scope ``model``) and what this machine must have for
them (scope ``device``). The requirements follow megatron-core 0.19.2
(``transformer/transformer_config.py``)."""

from __future__ import annotations

import importlib.util

from megatron_hybrid.pattern import DSA, GDN, MAMBA, MLA, MOE
from megatron_hybrid.training import capabilities
from megatron_hybrid.training.settings import Rule, Settings, rule

__all__ = ["DEVICE_RULES", "MODEL_RULES"]


def _moe_needs_experts(s: Settings) -> str | None:
    if s.has(MOE) and not s.args.num_experts:
        return (
            f"the pattern {s.args.hybrid_layer_pattern!r} has MoE ('E') layers; set --num-experts"
        )
    return None


def _topk(s: Settings) -> str | None:
    if s.has(MOE) and s.args.moe_router_topk > s.args.num_experts:
        return (
            f"--moe-router-topk {s.args.moe_router_topk} exceeds --num-experts "
            f"{s.args.num_experts}: "
            f"use at most {s.args.num_experts} experts per token"
        )
    return None


def _topk_one(s: Settings) -> str | None:
    if s.has(MOE) and s.args.moe_router_topk == 1 and not s.args.moe_router_pre_softmax:
        # A softmax over one selected score is constant 1: the router would get no gradient.
        return "--moe-router-topk 1 needs --moe-router-pre-softmax (softmax before the top-1)"
    return None


def _heads(s: Settings) -> str | None:
    if s.args.kv_channels is None and s.args.hidden_size < s.args.num_attention_heads:
        return (
            f"--hidden-size {s.args.hidden_size} is smaller than --num-attention-heads "
            f"{s.args.num_attention_heads}: a head needs at least one channel; set --kv-channels "
            "or use fewer heads"
        )
    return None


def _query_groups(s: Settings) -> str | None:
    groups = s.args.num_query_groups
    if groups and s.args.num_attention_heads % groups:
        return (
            f"--num-query-groups {groups} must divide --num-attention-heads "
            f"{s.args.num_attention_heads} (each group shares its keys and values among whole "
            "heads)"
        )
    return None


def _rope_head_dim(s: Settings) -> str | None:
    if s.args.position_embedding_type != "rope" or s.head_dim % 2 == 0:
        return None
    if s.args.kv_channels is not None:
        source = f"--kv-channels {s.args.kv_channels}"
    else:
        source = (
            f"--hidden-size {s.args.hidden_size} / --num-attention-heads "
            f"{s.args.num_attention_heads}"
        )
    return (
        f"RoPE rotates channel pairs, but the head dimension is {s.head_dim} ({source}): make "
        f"it even, e.g. --kv-channels {s.head_dim + 1}"
    )


def _mla(s: Settings) -> str | None:
    if not s.has(MLA) or s.args.transformer_impl != "local":
        return None
    if not capabilities.mla_core_attention_usable("local"):
        return (
            "'+' (MLA) layers with --transformer-impl local need a core attention with separate "
            "key and value head dims, which megatron-core 0.19.2's local attention lacks: use "
            "--transformer-impl transformer_engine on GPUs"
        )
    return None


def _mla_rope(s: Settings) -> str | None:
    if s.has(MLA) and s.args.qk_pos_emb_head_dim % 2:
        return (
            f"--qk-pos-emb-head-dim {s.args.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)"
        )
    return None


def _learned_positions(s: Settings) -> str | None:
    limit = s.args.max_position_embeddings
    if s.args.position_embedding_type == "learned_absolute" and limit and limit < s.args.seq_length:
        return (
            f"--max-position-embeddings {limit} is below --seq-length {s.args.seq_length}: learned "
            f"absolute positions exist only up to {limit}; raise it or lower --seq-length"
        )
    return None


def _gdn(s: Settings) -> str | None:
    if s.has(GDN) and not s.args.swiglu:
        return (
            "GatedDeltaNet ('G') layers use the model's activation, which must be SiLU: "
            "add --swiglu"
        )
    return None


def _gdn_kernels(s: Settings) -> str | None:
    if not s.has(GDN) or not s.on_gpu:
        return None
    if not capabilities.fla_installed():
        return "GatedDeltaNet ('G') layers on GPUs need fla-core: pip install fla-core"
    reason = capabilities.fla_gated_backward_refused()
    if reason:
        return f"'G' layers: {reason}; pip install 'triton>=3.7.1' or pip install tilelang"
    return None


def _mamba_sizes(s: Settings) -> str | None:
    """Mamba heads and groups must split evenly (megatron-core's ``MambaMixer`` asserts it)."""
    if not s.has(MAMBA):
        return None
    d_inner = 2 * s.args.hidden_size  # MambaMixer's expand = 2
    if s.args.mamba_num_heads is None and d_inner % s.args.mamba_head_dim:
        return (
            f"Mamba ('M') layers have 2 x --hidden-size = {d_inner} channels, not a multiple of "
            f"--mamba-head-dim {s.args.mamba_head_dim}; change --mamba-head-dim or set "
            "--mamba-num-heads"
        )
    heads = s.args.mamba_num_heads or d_inner // s.args.mamba_head_dim
    if heads % s.args.mamba_num_groups or s.args.mamba_num_groups % s.tp:
        return (
            f"Mamba ('M') layers have {heads} heads in --mamba-num-groups "
            f"{s.args.mamba_num_groups} "
            f"groups over TP {s.tp}: groups must divide the heads and TP must divide the "
            "groups; change --mamba-num-groups (or --mamba-num-heads)"
        )
    return None


def _mamba(s: Settings) -> str | None:
    if not s.has(MAMBA) or s.args.mamba_impl != "kernels":
        return None  # 'auto' falls back to the torch Mamba2 path where the kernels cannot run
    usable, reason = capabilities.mamba_kernels_usable()
    if not usable:
        return (
            f"--mamba-impl kernels needs megatron-core's Mamba kernels, but {reason}: install "
            "mamba-ssm and causal-conv1d on a CUDA machine, or use --mamba-impl auto (the torch "
            "Mamba2 path)"
        )
    return None


def _dsa(s: Settings) -> str | None:
    if s.has(DSA):
        return (
            "'D' (DeepSeek sparse attention) layers need DSA indexer settings that these flags "
            "do not cover: build them through the Python API (MLATransformerConfig with "
            "dsa_indexer_* fields and hybrid_stack_spec('te'))"
        )
    return None


def _transformer_engine(s: Settings) -> str | None:
    if s.args.transformer_impl != "transformer_engine":
        return None
    if not s.on_gpu:
        return "--transformer-impl transformer_engine needs CUDA GPUs; use --transformer-impl local"
    if importlib.util.find_spec("transformer_engine") is None:
        return (
            "--transformer-impl transformer_engine needs TransformerEngine, which is not "
            "installed; install it or use --transformer-impl local"
        )
    return None


def _cuda_graphs(s: Settings) -> str | None:
    if not s.args.hybrid_cuda_graphs:
        return None
    if not s.on_gpu:
        return "--hybrid-cuda-graphs captures CUDA graphs, which need GPUs; drop it on a CPU"
    if s.args.recompute_granularity:
        return (
            "--hybrid-cuda-graphs cannot replay forwards that recompute re-runs in backward: "
            "drop --recompute-granularity or --hybrid-cuda-graphs"
        )
    return None


#: Model rules, in the order they are checked.
MODEL_RULES: tuple[Rule, ...] = (
    rule("model", "--num-experts", _moe_needs_experts),
    rule("model", "--moe-router-topk --num-experts", _topk),
    rule("model", "--moe-router-topk --moe-router-pre-softmax", _topk_one),
    rule("model", "--hidden-size --num-attention-heads --kv-channels", _heads),
    rule("model", "--num-query-groups --num-attention-heads", _query_groups),
    rule("model", "--hidden-size --num-attention-heads --kv-channels", _rope_head_dim),
    rule("model", "--qk-pos-emb-head-dim", _mla_rope),
    rule("model", "--max-position-embeddings --seq-length", _learned_positions),
    rule("model", "--swiglu", _gdn),
    rule("model", "--mamba-head-dim --mamba-num-groups --mamba-num-heads", _mamba_sizes),
    rule("model", "--hybrid-layer-pattern", _dsa),
)

#: Device rules, in the order they are checked.
DEVICE_RULES: tuple[Rule, ...] = (
    rule("device", "--hybrid-layer-pattern", _gdn_kernels),
    rule("device", "--hybrid-layer-pattern", _mamba),
    rule("device", "--transformer-impl", _transformer_engine),
    rule("device", "--hybrid-cuda-graphs", _cuda_graphs),
    rule("device", "--hybrid-layer-pattern --transformer-impl", _mla),
)

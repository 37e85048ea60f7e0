"""DeepSeek-V3: multi-latent attention (``+``), dense first layers, a sigmoid router with expert
bias and group-limited top-k, ``routed_scaling_factor``.

transformers 5.23 (``models/deepseek_v3``): layers ``< first_k_dense_replace`` end in a SwiGLU
MLP, the others in a MoE (``[+-]{k}[+E]{N-k}``). The router scores are ``sigmoid(logits)``,
chosen by ``scores + e_score_correction_bias`` within the ``topk_group`` best of ``n_group``
groups, renormalised and scaled by ``routed_scaling_factor``: megatron-core's
``moe_router_score_function="sigmoid"``, ``moe_router_enable_expert_bias``,
``moe_router_num_groups``/``moe_router_group_topk`` and ``moe_router_topk_scaling_factor``.
``e_score_correction_bias`` is a float32 buffer in both (HF keeps it fp32 when saving bf16).
With ``rope_interleave`` HF de-interleaves the rotary channels before rotating, which megatron's
MLA RoPE does as well, so no weight is permuted.

MTP: the real checkpoint's MTP depth ``d`` is decoder layer ``num_hidden_layers + d``
(``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and an MoE layer's weights, plus copies
of the embedding and the output head as ``embed_tokens`` and ``shared_head.head``), as
DeepSeek's ``inference/convert.py`` reads it; transformers drops it.
"""

from __future__ import annotations

import torch

from megatron_hybrid.checkpointing.keys import final_norm_prefix, mtp_layer_prefix
from megatron_hybrid.hf.config import (
    ConfigReader,
    Family,
    HFConversion,
    dtype_name,
    register_family,
)
from megatron_hybrid.hf.families.common import (
    gated_mlp,
    rope_fields,
    routed_experts,
    sigmoid_router,
)
from megatron_hybrid.hf.plan import PlanBuilder
from megatron_hybrid.pattern import parse_pattern

__all__ = ["DEEPSEEK_V3"]

_MTP_FIELDS = ("num_nextn_predict_layers", "num_mtp_layers")

# What the official FP8 checkpoint keeps unquantized. Its quantization_config names no
# modules: deepseek-ai/DeepSeek-V3 README_WEIGHTS.md ("FP8 Weight Documentation") and
# inference/model.py (every `Linear` of attention and MLP, experts and shared experts included,
# is float8 with a 128 x 128 float32 `scale`; `ParallelEmbedding`, `Gate` and the output head
# are bfloat16) give the rest; the MTP layer's `eh_proj` is bfloat16 too (vLLM's
# deepseek_mtp.py builds it as a plain nn.Linear with no quantization), and its
# `shared_head.head` is a copy of lm_head.
_FP8_UNQUANTIZED = ("embed_tokens", "lm_head", "mlp.gate", "eh_proj", "shared_head.head")
_YARN = {
    "factor": "rotary_scaling_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}


def _to_megatron(hf: dict, *, mtp=None, has_tensor=None) -> HFConversion:
    r = ConfigReader(
        hf,
        (
            "router_aux_loss_coef",
            "aux_loss_alpha",
            "seq_aux",
            "scoring_func",
            "topk_method",
            "moe_layer_freq",
            "ep_size",
        ),
    )
    notes: list[str] = []
    layers = int(r.require("num_hidden_layers"))
    dense = int(r.get("first_k_dense_replace", 0) or 0)
    freq = r.config.get("moe_layer_freq", 1)
    if freq not in (1, None):
        r.unsupported.append(("moe_layer_freq", f"{freq!r}: only every layer after the dense ones"))
    if r.config.get("scoring_func", "sigmoid") != "sigmoid":
        r.unsupported.append(("scoring_func", "only 'sigmoid' (DeepSeek-V3) is mapped"))
    if r.config.get("topk_method", "noaux_tc") != "noaux_tc":
        r.unsupported.append(("topk_method", "only 'noaux_tc' (DeepSeek-V3) is mapped"))
    declared = max(int(r.get(n) or 0) for n in _MTP_FIELDS)
    depths = 0
    if mtp is not False and declared:
        present = has_tensor is None or has_tensor(f"model.layers.{layers}.eh_proj.weight")
        if present:
            depths = declared
        elif mtp:
            r.unsupported.append(("mtp", "MTP was asked for, but the checkpoint has no MTP layer"))
        else:
            notes.append(
                f"the config declares {declared} MTP layer(s) but the checkpoint has no "
                f"model.layers.{layers}.* (transformers' save_pretrained drops them); built "
                "without MTP"
            )
    pattern = parse_pattern("[+-]" * dense + "[+E]" * (layers - dense) + "/+E" * depths)
    rope = rope_fields(r, allowed_types=("default", "yarn"))
    r.expect("hidden_act", ["silu"])
    r.expect("attention_bias", [False, None], False)
    r.expect(
        "rope_interleave",
        [True, None],
        True,
        " (megatron's MLA RoPE de-interleaves the rotary channels, as HF does with it)",
    )
    r.expect("norm_topk_prob", [True, None], True, " (megatron renormalises sigmoid top-k scores)")
    hidden = int(r.require("hidden_size"))
    heads = int(r.require("num_attention_heads"))
    kv_heads = r.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        r.unsupported.append(("num_key_value_heads", "MLA has one key/value head per query head"))
    experts = int(r.require("n_routed_experts"))
    shared = int(r.get("n_shared_experts", 0) or 0)
    kwargs = dict(
        num_layers=pattern.physical_layer_count,
        mtp_num_layers=depths or None,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=int(r.require("intermediate_size")),
        normalization="RMSNorm",
        layernorm_epsilon=float(r.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        attention_dropout=float(r.get("attention_dropout", 0.0) or 0.0),
        hidden_dropout=0.0,
        q_lora_rank=r.get("q_lora_rank"),
        kv_lora_rank=int(r.require("kv_lora_rank")),
        qk_head_dim=int(r.require("qk_nope_head_dim")),
        qk_pos_emb_head_dim=int(r.require("qk_rope_head_dim")),
        v_head_dim=int(r.require("v_head_dim")),
        rope_type="yarn" if rope["rope_type"] == "yarn" else "rope",
        rotary_base=float(rope["rope_theta"]),
        num_moe_experts=experts,
        moe_router_topk=int(r.require("num_experts_per_tok")),
        moe_ffn_hidden_size=int(r.require("moe_intermediate_size")),
        moe_shared_expert_intermediate_size=(
            int(r.config["moe_intermediate_size"]) * shared if shared else None
        ),
        **sigmoid_router(r),
    )
    # Derived fields transformers writes: check them instead of ignoring them.
    nope, rope_dim = kwargs["qk_head_dim"], kwargs["qk_pos_emb_head_dim"]
    r.expect("qk_head_dim", [nope + rope_dim, None], nope + rope_dim)
    r.expect("head_dim", [rope_dim, None], rope_dim)
    if rope["rope_type"] == "yarn":
        for hf_name, mc_name in _YARN.items():
            if hf_name in rope:
                kwargs[mc_name] = rope[hf_name]
    model_kwargs = dict(
        vocab_size=int(r.require("vocab_size")),
        max_sequence_length=int(r.get("max_position_embeddings", 4096)),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=bool(r.get("tie_word_embeddings", False)),
    )
    return HFConversion(
        family="deepseek_v3",
        hf_config=hf,
        config_kwargs=kwargs,
        mla=True,
        pattern=pattern,
        model_kwargs=model_kwargs,
        hf_prefix="model.",
        dtype=r.dtype(),
        mtp_layers=depths,
        unsupported=r.finish(),
        notes=notes,
    )


def _mla(b: PlanBuilder, p: str, h: str, cfg: dict) -> None:
    s = "self_attention."
    a = f"{h}self_attn."
    b.copy(
        b.key(
            p,
            "input_layernorm.weight",
            f"{s}linear_q_down_proj.layer_norm_weight",
            f"{s}linear_q_proj.layer_norm_weight",
        ),
        f"{h}input_layernorm.weight",
    )
    if cfg.get("q_lora_rank"):
        b.copy(b.key(p, f"{s}linear_q_down_proj.weight"), f"{a}q_a_proj.weight")
        b.copy(
            b.key(p, f"{s}q_layernorm.weight", f"{s}linear_q_up_proj.layer_norm_weight"),
            f"{a}q_a_layernorm.weight",
        )
        b.copy(b.key(p, f"{s}linear_q_up_proj.weight"), f"{a}q_b_proj.weight")
    else:
        b.copy(b.key(p, f"{s}linear_q_proj.weight"), f"{a}q_proj.weight")
    b.copy(b.key(p, f"{s}linear_kv_down_proj.weight"), f"{a}kv_a_proj_with_mqa.weight")
    b.copy(
        b.key(p, f"{s}kv_layernorm.weight", f"{s}linear_kv_up_proj.layer_norm_weight"),
        f"{a}kv_a_layernorm.weight",
    )
    b.copy(b.key(p, f"{s}linear_kv_up_proj.weight"), f"{a}kv_b_proj.weight")
    b.copy(b.key(p, f"{s}linear_proj.weight"), f"{a}o_proj.weight")


def _mlp_slot(b: PlanBuilder, symbol: str, p: str, h: str, cfg: dict) -> None:
    b.copy(
        b.key(p, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
        f"{h}post_attention_layernorm.weight",
    )
    if symbol == "-":
        gated_mlp(b, f"{p}mlp.", f"{h}mlp.", cfg["ffn_hidden_size"])
        return
    gate = f"{h}mlp.gate."
    b.copy(b.key(p, "mlp.router.weight"), f"{gate}weight")
    b.copy(b.key(p, "mlp.router.expert_bias"), f"{gate}e_score_correction_bias")
    b.fp32(f"{gate}e_score_correction_bias")
    routed_experts(b, p, f"{h}mlp.", cfg["num_moe_experts"], cfg["moe_ffn_hidden_size"])
    if cfg.get("moe_shared_expert_intermediate_size"):
        gated_mlp(
            b,
            f"{p}mlp.shared_experts.",
            f"{h}mlp.shared_experts.",
            cfg["moe_shared_expert_intermediate_size"],
        )


def _plan(b: PlanBuilder, conversion: HFConversion) -> None:
    cfg = conversion.config_kwargs
    pattern = conversion.pattern
    prefix = conversion.hf_prefix
    embed, head = f"{prefix}embed_tokens.weight", "lm_head.weight"
    b.copy(b.key("", "embedding.word_embeddings.weight"), embed)
    for layer in pattern.logical_layers:
        p, h = f"decoder.layers.{layer.index}.", f"{prefix}layers.{layer.index}."
        _mla(b, p, h, cfg)
        _mlp_slot(b, layer.members[1], p, h, cfg)
    b.copy(b.key(final_norm_prefix(pattern), "weight"), f"{prefix}norm.weight")
    if not conversion.model_kwargs["share_embeddings_and_output_weights"]:
        b.copy(b.key("", "output_layer.weight"), head)
    for depth in range(pattern.mtp_num_depths):
        p = f"mtp.layers.{depth}."
        h = f"{prefix}layers.{pattern.logical_layer_count + depth}."
        b.copy(b.key(p, "enorm.weight"), f"{h}enorm.weight")
        b.copy(b.key(p, "hnorm.weight"), f"{h}hnorm.weight")
        b.copy(b.key(p, "eh_proj.weight"), f"{h}eh_proj.weight")
        inner = mtp_layer_prefix(depth, 0, pattern)
        _mla(b, inner, h, cfg)
        _mlp_slot(b, pattern.mtp_items[1], inner, h, cfg)
        b.copy(
            b.key(p, "final_layernorm.weight", "layer_norm.weight"), f"{h}shared_head.norm.weight"
        )
        b.shared(f"{h}embed_tokens.weight", embed)
        if head in b.hf_shapes:
            b.shared(f"{h}shared_head.head.weight", head)


def _to_hf_config(conversion: HFConversion) -> dict:
    c = conversion.config_kwargs
    dense = sum(1 for layer in conversion.pattern.logical_layers if layer.members[1] == "-")
    shared = c.get("moe_shared_expert_intermediate_size") or 0
    out = dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=conversion.model_kwargs["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["ffn_hidden_size"],
        moe_intermediate_size=c["moe_ffn_hidden_size"],
        num_hidden_layers=conversion.pattern.logical_layer_count,
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_attention_heads"],
        n_shared_experts=shared // c["moe_ffn_hidden_size"],
        n_routed_experts=c["num_moe_experts"],
        routed_scaling_factor=c["moe_router_topk_scaling_factor"],
        kv_lora_rank=c["kv_lora_rank"],
        q_lora_rank=c["q_lora_rank"],
        qk_rope_head_dim=c["qk_pos_emb_head_dim"],
        v_head_dim=c["v_head_dim"],
        qk_nope_head_dim=c["qk_head_dim"],
        n_group=c.get("moe_router_num_groups") or 1,
        topk_group=c.get("moe_router_group_topk") or 1,
        num_experts_per_tok=c["moe_router_topk"],
        first_k_dense_replace=dense,
        norm_topk_prob=True,
        hidden_act="silu",
        max_position_embeddings=conversion.model_kwargs["max_sequence_length"],
        rms_norm_eps=c["layernorm_epsilon"],
        tie_word_embeddings=conversion.model_kwargs["share_embeddings_and_output_weights"],
        rope_interleave=True,
        attention_bias=False,
        dtype=dtype_name(conversion.dtype),
    )
    rope = dict(
        rope_type="default" if c["rope_type"] == "rope" else "yarn", rope_theta=c["rotary_base"]
    )
    if c["rope_type"] == "yarn":
        rope.update({hf: c[mc] for hf, mc in _YARN.items() if mc in c})
    out["rope_parameters"] = rope
    if conversion.mtp_layers:
        out["num_nextn_predict_layers"] = conversion.mtp_layers
    source = {k: v for k, v in conversion.hf_config.items() if k not in out}
    return {**out, **source}


DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    to_megatron=_to_megatron,
    plan=_plan,
    to_hf_config=_to_hf_config,
    fp8_unquantized=_FP8_UNQUANTIZED,
)
register_family(DEEPSEEK_V3)

"""Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next: GatedDeltaNet + gated attention stacks.

transformers 5.23 (``models/qwen3_5``, ``qwen3_5_moe``, ``qwen3_next``): ``layer_types`` says per
layer ``linear_attention`` (GatedDeltaNet, ``G``) or ``full_attention`` (``*``, with an output
gate inside ``q_proj`` and zero-centred q/k norms); each layer ends in a MoE (``E``: softmax
router, renormalised top-k, a shared expert behind a sigmoid gate) or, for the dense family and
``mlp_only_layers``, a SwiGLU MLP (``-``). Every layer is one group: ``([GE]{3}[*E]){N/4}``.
All RMSNorms except GatedDeltaNet's gated output norm are zero-centred (``x_hat * (1 + w)``).
Qwen3-Next stores GatedDeltaNet's input projections head-grouped (``in_proj_qkvz``,
``in_proj_ba``), Qwen3.5 flat (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).

MTP: the real checkpoints carry one MTP layer as ``mtp.*`` (``mtp.fc`` = megatron's ``eh_proj``
over ``[embedding; hidden]``, ``mtp.pre_fc_norm_embedding``/``_hidden`` = ``enorm``/``hnorm``,
``mtp.norm`` = the depth's final norm, ``mtp.layers.0.*`` a full-attention decoder layer), names
as vLLM's ``qwen3_next_mtp.py`` loads them; transformers drops them (``_keys_to_ignore_on_load
_unexpected = ["^mtp.*"]``), so they are proven by names and a round trip.
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
    qkv_interleave,
    rope_fields,
    routed_experts,
)
from megatron_hybrid.hf.plan import PlanBuilder
from megatron_hybrid.pattern import parse_pattern

__all__ = ["QWEN3_5", "QWEN3_5_MOE", "QWEN3_NEXT"]

_IGNORED = ("router_aux_loss_coef", "mtp_use_dedicated_embeddings", "full_attention_interval")

# The modules the official FP8 releases keep unquantized, from their config.json's
# quantization_config.modules_to_not_convert (per-layer entries reduced to module names; the
# lists also name norms, conv1d, A_log and dt_bias, which are not 2-D and never FP8):
# - Qwen/Qwen3-Next-80B-A3B-Instruct-FP8 (transformers 5.7.0 config): lm_head,
#   linear_attn.in_proj_ba, mlp.gate, mlp.shared_expert_gate, mtp.fc;
# - Qwen/Qwen3.6-35B-A3B-FP8 (model_type qwen3_5_moe, the Qwen3.5 architecture):
#   lm_head, embed_tokens, linear_attn.in_proj_a, linear_attn.in_proj_b, mlp.gate,
#   mlp.shared_expert_gate, mtp.fc and the vision tower (model.visual.blocks.*).
# The embedding is listed for all: it is no linear layer, and no release quantizes it.
_FP8_QWEN3_NEXT = (
    "embed_tokens",
    "lm_head",
    "linear_attn.in_proj_ba",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "mtp.fc",
)
_FP8_QWEN3_5 = (
    "embed_tokens",
    "lm_head",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "mtp.fc",
)
# The vision tower of the multimodal Qwen3.5 checkpoints (Qwen3_5*ForConditionalGeneration,
# transformers 5.23: model.visual.*, described by config.json's vision_config).
_VISION = (("vision_config", "model.visual."),)
_MTP_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def _mtp_depths(reader: ConfigReader, mtp, has_tensor, notes) -> int:
    declared = 0
    for name in _MTP_FIELDS:
        declared = max(declared, int(reader.get(name) or 0))
    if declared > 1:
        reader.unsupported.append(
            (
                "mtp_num_hidden_layers",
                f"{declared} MTP layers share one fc/norm set in Qwen; "
                "megatron's MTP has them per depth (one layer is supported)",
            )
        )
    if mtp is False or declared == 0:
        return 0
    present = has_tensor is None or has_tensor("mtp.fc.weight")
    if not present:
        if mtp:
            reader.unsupported.append(("mtp", "MTP was asked for, but the checkpoint has no mtp.*"))
        else:
            notes.append(
                f"the config declares {declared} MTP layer(s) but the checkpoint holds no mtp.* "
                "tensors (transformers' save_pretrained drops them); built without MTP"
            )
        return 0
    return declared


def _to_megatron(hf: dict, *, moe: bool, name: str, mtp=None, has_tensor=None):
    r = ConfigReader(hf, _IGNORED)
    notes: list[str] = []
    layers = int(r.require("num_hidden_layers"))
    layer_types = r.get("layer_types")
    if layer_types is None:
        interval = int(r.config.get("full_attention_interval", 4))
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    if len(layer_types) != layers:
        r.unsupported.append(("layer_types", f"{len(layer_types)} entries for {layers} layers"))
    mixer = {"linear_attention": "G", "full_attention": "*"}
    for t in set(layer_types) - set(mixer):
        r.unsupported.append(("layer_types", f"layer type {t!r} is not supported"))
    mlp_only = set(r.get("mlp_only_layers") or [])
    sparse_step = int(r.get("decoder_sparse_step", 1) or 1)
    mlp_symbols = []
    for i in range(layers):
        is_moe = moe and i not in mlp_only and (i + 1) % sparse_step == 0
        mlp_symbols.append("E" if is_moe else "-")
    main = "".join(
        f"[{mixer.get(t, '*')}{m}]" for t, m in zip(layer_types, mlp_symbols, strict=False)
    )
    depths = _mtp_depths(r, mtp, has_tensor, notes)
    mtp_symbol = "E" if moe else "-"
    pattern = parse_pattern(main + f"/*{mtp_symbol}" * depths)
    rope = rope_fields(r)
    r.expect("hidden_act", ["silu"])
    r.expect("attention_bias", [False, None], False, " (no q/k/v biases are mapped)")
    hidden = int(r.require("hidden_size"))
    heads = int(r.require("num_attention_heads"))
    head_dim = int(r.get("head_dim") or hidden // heads)
    kwargs = dict(
        num_layers=pattern.physical_layer_count,
        mtp_num_layers=depths or None,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(r.get("num_key_value_heads") or heads),
        kv_channels=head_dim,
        ffn_hidden_size=int(
            r.get("intermediate_size") or r.get("moe_intermediate_size") or 4 * hidden
        ),
        normalization="RMSNorm",
        layernorm_epsilon=float(r.get("rms_norm_eps", 1e-6)),
        layernorm_zero_centered_gamma=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        attention_output_gate=True,
        attention_dropout=float(r.get("attention_dropout", 0.0) or 0.0),
        hidden_dropout=0.0,
        linear_num_key_heads=int(r.require("linear_num_key_heads")),
        linear_num_value_heads=int(r.require("linear_num_value_heads")),
        linear_key_head_dim=int(r.require("linear_key_head_dim")),
        linear_value_head_dim=int(r.require("linear_value_head_dim")),
        linear_conv_kernel_dim=int(r.get("linear_conv_kernel_dim", 4)),
    )
    if moe:
        norm_topk = r.get("norm_topk_prob", True)
        kwargs.update(
            num_moe_experts=int(r.require("num_experts")),
            moe_router_topk=int(r.require("num_experts_per_tok")),
            moe_ffn_hidden_size=int(r.require("moe_intermediate_size")),
            moe_shared_expert_intermediate_size=int(r.require("shared_expert_intermediate_size")),
            moe_shared_expert_gate=True,
            moe_router_score_function="softmax",
            # top-k of the logits then softmax over them == softmax, top-k, renormalise.
            moe_router_pre_softmax=not norm_topk,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0,
        )
    model_kwargs = dict(
        vocab_size=int(r.require("vocab_size")),
        max_sequence_length=int(r.get("max_position_embeddings", 4096)),
        position_embedding_type="rope",
        rotary_percent=float(rope["partial_rotary_factor"]),
        rotary_base=float(rope["rope_theta"]),
        share_embeddings_and_output_weights=bool(r.get("tie_word_embeddings", False)),
    )
    dtype = r.dtype()
    return HFConversion(
        family=name,
        hf_config=hf,
        config_kwargs=kwargs,
        mla=False,
        pattern=pattern,
        model_kwargs=model_kwargs,
        hf_prefix="model.",
        dtype=dtype,
        mtp_layers=depths,
        unsupported=r.finish(),
        notes=notes,
    )


def _gdn(b: PlanBuilder, p: str, h: str, cfg: dict, hidden: int, grouped: bool) -> None:
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    q, v = nk * dk, nv * dv
    b.copy(
        b.key(p, "input_layernorm.weight", "self_attention.in_proj.layer_norm_weight"),
        f"{h}input_layernorm.weight",
    )
    names = ("query", "key", "value", "z", "beta", "alpha")
    keys = dict(
        zip(names, (b.key(p, f"self_attention.in_proj.weight.{n}") for n in names), strict=True)
    )
    a = f"{h}linear_attn."
    if grouped:
        r = nv // nk
        group = 2 * dk + 2 * r * dv
        qkvz, ba = f"{a}in_proj_qkvz.weight", f"{a}in_proj_ba.weight"
        b.hf(qkvz, (nk * group, hidden))
        b.hf(ba, (nk * 2 * r, hidden))
        offsets = {
            "query": (0, dk),
            "key": (dk, dk),
            "value": (2 * dk, r * dv),
            "z": (2 * dk + r * dv, r * dv),
        }
        for n, (start, size) in offsets.items():
            b.gather(
                keys[n], qkvz, [hh * group + start + i for hh in range(nk) for i in range(size)]
            )
        for n, start in (("beta", 0), ("alpha", r)):
            b.gather(keys[n], ba, [hh * 2 * r + start + i for hh in range(nk) for i in range(r)])
    else:
        b.split(
            f"{a}in_proj_qkv.weight", [(keys["query"], q), (keys["key"], q), (keys["value"], v)]
        )
        b.copy(keys["z"], f"{a}in_proj_z.weight")
        b.copy(keys["beta"], f"{a}in_proj_b.weight")
        b.copy(keys["alpha"], f"{a}in_proj_a.weight")
    conv = [b.key(p, f"self_attention.conv1d.weight.{n}") for n in ("query", "key", "value")]
    b.split(f"{a}conv1d.weight", [(conv[0], q), (conv[1], q), (conv[2], v)])
    b.copy(b.key(p, "self_attention.A_log"), f"{a}A_log")
    b.copy(b.key(p, "self_attention.dt_bias"), f"{a}dt_bias")
    b.copy(b.key(p, "self_attention.out_norm.weight"), f"{a}norm.weight")
    b.copy(b.key(p, "self_attention.out_proj.weight"), f"{a}out_proj.weight")


def _attention(b: PlanBuilder, p: str, h: str, cfg: dict) -> None:
    b.copy(
        b.key(p, "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
        f"{h}input_layernorm.weight",
    )
    qkv_interleave(
        b,
        b.key(p, "self_attention.linear_qkv.weight"),
        f"{h}self_attn.",
        heads=cfg["num_attention_heads"],
        groups=cfg["num_query_groups"],
        head_dim=cfg["kv_channels"],
        hidden=cfg["hidden_size"],
        output_gate=True,
    )
    b.copy(b.key(p, "self_attention.q_layernorm.weight"), f"{h}self_attn.q_norm.weight")
    b.copy(b.key(p, "self_attention.k_layernorm.weight"), f"{h}self_attn.k_norm.weight")
    b.copy(b.key(p, "self_attention.linear_proj.weight"), f"{h}self_attn.o_proj.weight")


def _mlp_norm(b: PlanBuilder, p: str, h: str) -> None:
    b.copy(
        b.key(p, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
        f"{h}post_attention_layernorm.weight",
    )


def _moe(b: PlanBuilder, p: str, h: str, cfg: dict) -> None:
    _mlp_norm(b, p, h)
    b.copy(b.key(p, "mlp.router.weight"), f"{h}mlp.gate.weight")
    routed_experts(b, p, f"{h}mlp.", cfg["num_moe_experts"], cfg["moe_ffn_hidden_size"])
    gated_mlp(
        b,
        f"{p}mlp.shared_experts.",
        f"{h}mlp.shared_expert.",
        cfg["moe_shared_expert_intermediate_size"],
    )
    b.copy(b.key(p, "mlp.shared_experts.gate_weight"), f"{h}mlp.shared_expert_gate.weight")


def _dense(b: PlanBuilder, p: str, h: str, cfg: dict) -> None:
    _mlp_norm(b, p, h)
    gated_mlp(b, f"{p}mlp.", f"{h}mlp.", cfg["ffn_hidden_size"])


def layer_links(b, conversion: HFConversion, members, p: str, h: str, grouped: bool) -> None:
    """Links of one Qwen layer (``members`` = its pattern symbols)."""
    cfg = conversion.config_kwargs
    for symbol in members:
        if symbol == "G":
            _gdn(b, p, h, cfg, cfg["hidden_size"], grouped)
        elif symbol == "*":
            _attention(b, p, h, cfg)
        elif symbol == "E":
            _moe(b, p, h, cfg)
        elif symbol == "-":
            _dense(b, p, h, cfg)
        else:  # the pattern comes from _to_megatron, which makes only these symbols
            raise AssertionError(symbol)


def _plan(b: PlanBuilder, conversion: HFConversion, *, grouped: bool) -> None:
    pattern = conversion.pattern
    prefix = conversion.hf_prefix
    b.copy(b.key("", "embedding.word_embeddings.weight"), f"{prefix}embed_tokens.weight")
    for layer in pattern.logical_layers:
        layer_links(
            b,
            conversion,
            layer.members,
            f"decoder.layers.{layer.index}.",
            f"{prefix}layers.{layer.index}.",
            grouped,
        )
    b.copy(b.key(final_norm_prefix(pattern), "weight"), f"{prefix}norm.weight")
    if not conversion.model_kwargs["share_embeddings_and_output_weights"]:
        b.copy(b.key("", "output_layer.weight"), "lm_head.weight")
    for depth in range(pattern.mtp_num_depths):
        p = f"mtp.layers.{depth}."
        b.copy(b.key(p, "enorm.weight"), "mtp.pre_fc_norm_embedding.weight")
        b.copy(b.key(p, "hnorm.weight"), "mtp.pre_fc_norm_hidden.weight")
        b.copy(b.key(p, "eh_proj.weight"), "mtp.fc.weight")
        layer_links(
            b,
            conversion,
            pattern.mtp_items,
            mtp_layer_prefix(depth, 0, pattern),
            f"mtp.layers.{depth}.",
            grouped,
        )
        b.copy(b.key(p, "final_layernorm.weight", "layer_norm.weight"), "mtp.norm.weight")


def _to_hf_config(conversion: HFConversion, *, model_type: str, architecture: str) -> dict:
    """config.json from the conversion (the source's fields win where it has them)."""
    c = conversion.config_kwargs
    layer_types = [
        "linear_attention" if layer.members[0] == "G" else "full_attention"
        for layer in conversion.pattern.logical_layers
    ]
    out = dict(
        model_type=model_type,
        architectures=[architecture],
        vocab_size=conversion.model_kwargs["vocab_size"],
        hidden_size=c["hidden_size"],
        num_hidden_layers=len(layer_types),
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_query_groups"],
        head_dim=c["kv_channels"],
        hidden_act="silu",
        max_position_embeddings=conversion.model_kwargs["max_sequence_length"],
        rms_norm_eps=c["layernorm_epsilon"],
        tie_word_embeddings=conversion.model_kwargs["share_embeddings_and_output_weights"],
        attention_bias=False,
        attention_dropout=c.get("attention_dropout", 0.0),
        layer_types=layer_types,
        linear_num_key_heads=c["linear_num_key_heads"],
        linear_num_value_heads=c["linear_num_value_heads"],
        linear_key_head_dim=c["linear_key_head_dim"],
        linear_value_head_dim=c["linear_value_head_dim"],
        linear_conv_kernel_dim=c["linear_conv_kernel_dim"],
        rope_parameters=dict(
            rope_type="default",
            rope_theta=conversion.model_kwargs["rotary_base"],
            partial_rotary_factor=conversion.model_kwargs["rotary_percent"],
        ),
        dtype=dtype_name(conversion.dtype),
    )
    if c.get("num_moe_experts"):
        out.update(
            num_experts=c["num_moe_experts"],
            num_experts_per_tok=c["moe_router_topk"],
            moe_intermediate_size=c["moe_ffn_hidden_size"],
            shared_expert_intermediate_size=c["moe_shared_expert_intermediate_size"],
        )
        if model_type == "qwen3_next":
            out["norm_topk_prob"] = not c.get("moe_router_pre_softmax", False)
            out["intermediate_size"] = c["ffn_hidden_size"]
    else:
        out["intermediate_size"] = c["ffn_hidden_size"]
    if conversion.mtp_layers:
        out["mtp_num_hidden_layers"] = conversion.mtp_layers
    source = {k: v for k, v in conversion.hf_config.items() if k not in out or k == "architectures"}
    return {**out, **source, "model_type": model_type}


def _family(
    name: str,
    model_types: tuple[str, ...],
    *,
    moe: bool,
    grouped: bool,
    arch: str,
    fp8: tuple[str, ...],
    carried=(),
):
    return Family(
        name=name,
        model_types=model_types,
        to_megatron=lambda hf, mtp=None, has_tensor=None: _to_megatron(
            hf, moe=moe, name=name, mtp=mtp, has_tensor=has_tensor
        ),
        plan=lambda b, conversion: _plan(b, conversion, grouped=grouped),
        to_hf_config=lambda conversion: _to_hf_config(
            conversion, model_type=model_types[0], architecture=arch
        ),
        text_prefixes=("model.", "model.language_model."),
        fp8_unquantized=fp8,
        carried_parts=carried,
    )


QWEN3_5 = _family(
    "qwen3_5",
    ("qwen3_5_text", "qwen3_5"),
    moe=False,
    grouped=False,
    arch="Qwen3_5ForCausalLM",
    fp8=_FP8_QWEN3_5,
    carried=_VISION,
)
QWEN3_5_MOE = _family(
    "qwen3_5_moe",
    ("qwen3_5_moe_text", "qwen3_5_moe"),
    moe=True,
    grouped=False,
    arch="Qwen3_5MoeForCausalLM",
    fp8=_FP8_QWEN3_5,
    carried=_VISION,
)
QWEN3_NEXT = _family(
    "qwen3_next",
    ("qwen3_next",),
    moe=True,
    grouped=True,
    arch="Qwen3NextForCausalLM",
    fp8=_FP8_QWEN3_NEXT,
)
for _f in (QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT):
    register_family(_f)

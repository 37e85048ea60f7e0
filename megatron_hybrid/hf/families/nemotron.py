"""Nemotron-H: Mamba2, MoE, attention and MLP blocks, one mixer and one pre-norm per block.

transformers 5.23 (``models/nemotron_h``): ``layers_block_type`` (or the legacy
``hybrid_override_pattern`` string) names each block ``linear_attention`` (Mamba2, ``M``),
``moe`` (``E``), ``full_attention`` (``*``) or ``mlp`` (``-``); every block is
``x + mixer(norm(x))``, which is megatron-core's ungrouped hybrid layout, so the pattern is the
override pattern itself (``M-M*-...``). On disk the decoder is ``backbone.*``
(``embeddings``, ``layers.{i}.norm``, ``layers.{i}.mixer.*``, ``norm_f``); experts are stored
per expert (``mixer.experts.{e}.{up,down}_proj``) and are not gated: ``relu2`` (squared ReLU)
everywhere, megatron's ``squared_relu`` with ``gated_linear_unit=False``. The router is
DeepSeek-V3's (sigmoid scores, ``e_score_correction_bias`` kept float32, ``n_group`` /
``topk_group``, renormalised top-k times ``routed_scaling_factor``); the shared expert is one
relu2 MLP of ``moe_shared_expert_intermediate_size`` (``n_shared_experts`` is not read by
transformers). Attention has no RoPE, no q/k norm, no biases.

Mamba2: ``in_proj`` rows are ``[z; x; B; C; dt]`` and ``conv1d`` channels ``[x; B; C]``, in
megatron-core's order; megatron's sharded state dict splits both into their components, so each
TP rank reads its own rows of each component. Two numerical differences from megatron-core's
``MambaMixer`` are carried to the torch Mamba2 path as mixer arguments
(:func:`mamba_mixer_params`): transformers clamps ``softplus(dt + dt_bias)`` from below at
``time_step_min`` (its mixer's ``time_step_limit``; the config's own ``time_step_limit`` is not
read), and its gated RMSNorm uses ``layer_norm_epsilon`` where megatron-core hard-codes 1e-5.

MTP (Nemotron-3): depth ``d`` of ``L = len(mtp_layers_block_type)`` blocks is stored flattened as
``mtp.layers.{d*L + i}.{norm,mixer}.*``, with ``enorm``/``hnorm``/``eh_proj`` on its first block
and ``final_layernorm`` on its last (Megatron-Bridge ``models/nemotronh/nemotron_h_bridge.py``);
transformers 5.23 does not model MTP, so these are proven by names and a round trip.
"""

from __future__ import annotations

from megatron.core.activations import squared_relu

from megatron_hybrid.checkpointing.keys import final_norm_prefix, mtp_layer_prefix
from megatron_hybrid.hf.config import (
    ConfigReader,
    Family,
    HFConversion,
    dtype_name,
    register_family,
)
from megatron_hybrid.hf.families.common import qkv_interleave, routed_experts, sigmoid_router
from megatron_hybrid.hf.plan import PlanBuilder
from megatron_hybrid.modules.mamba_torch import MEGATRON_GATED_NORM_EPS
from megatron_hybrid.pattern import MAMBA, MOE, parse_pattern

__all__ = ["NEMOTRON_H"]

#: HF block type -> pattern symbol (transformers' own ``_list_to_pattern`` table).
_SYMBOL = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}
_TYPE = {s: t for t, s in _SYMBOL.items()}
#: Legacy config names transformers 5.23 still accepts (``NemotronHConfig.__post_init__``).
_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
_IGNORED = (
    # Initialisation only.
    "time_step_max",
    "time_step_floor",
    "rescale_prenorm_residual",
    # Not read by transformers 5.23's forward (the mixer clamps at time_step_min instead).
    "time_step_limit",
    "residual_in_fp32",
    "n_shared_experts",
    # Kernel choice, decode caches and generation only.
    "use_mamba_kernels",
    "mamba_ssm_cache_dtype",
    "num_logits_to_keep",
    "router_aux_loss_coef",
    "moe_shared_expert_overlap",
    # The SSD chunk length does not change the function (the torch path checks any length).
    "chunk_size",
    # Derived: Mamba's inner width is mamba_num_heads * mamba_head_dim.
    "expand",
    "num_hidden_layers",
)


def _block_types(r: ConfigReader) -> list[str]:
    types = r.get("layers_block_type") or r.get("layer_types")
    override = r.get("hybrid_override_pattern")
    if types is None and isinstance(override, str):
        unknown = sorted(set(override) - set(_TYPE))
        if unknown:
            r.unsupported.append(
                ("hybrid_override_pattern", f"symbols {unknown} (Nemotron-H uses M, E, *, -)")
            )
        types = [_TYPE.get(s, "mlp") for s in override]
    if not types:
        r.unsupported.append(("layers_block_type", "is required (or hybrid_override_pattern)"))
        return []
    declared = r.config.get("num_hidden_layers")
    if declared is not None and int(declared) != len(types):
        r.unsupported.append(
            ("num_hidden_layers", f"{declared}, but layers_block_type has {len(types)} entries")
        )
    for t in sorted(set(types) - set(_SYMBOL)):
        r.unsupported.append(("layers_block_type", f"block type {t!r} is not known"))
    return list(types)


def _mtp_types(r: ConfigReader, mtp, has_tensor, notes: list[str]) -> tuple[int, list[str]]:
    declared = int(r.get("num_nextn_predict_layers") or 0)
    types = r.get("mtp_layers_block_type")
    legacy = r.get("mtp_hybrid_override_pattern")
    if types is None and isinstance(legacy, str):
        types = [_TYPE.get(s, "mlp") for s in legacy]
    types = list(types or ["full_attention", "moe"])
    if mtp is False or declared == 0:
        return 0, types
    if has_tensor is not None and not has_tensor("mtp.layers.0.eh_proj.weight"):
        if mtp:
            r.unsupported.append(("mtp", "MTP was asked for, but the checkpoint has no mtp.*"))
        else:
            notes.append(
                f"the config declares {declared} MTP layer(s) but the checkpoint holds no mtp.* "
                "tensors (transformers' save_pretrained drops them); built without MTP"
            )
        return 0, types
    return declared, types


def _to_megatron(hf: dict, *, mtp=None, has_tensor=None) -> HFConversion:
    hf = dict(hf)
    for old, new in _ALIASES.items():
        if old in hf and new not in hf:
            hf[new] = hf.pop(old)
    r = ConfigReader(hf, _IGNORED)
    notes: list[str] = []
    types = _block_types(r)
    depths, mtp_types = _mtp_types(r, mtp, has_tensor, notes)
    main = "".join(_SYMBOL.get(t, "-") for t in types)
    mtp_part = "".join(_SYMBOL.get(t, "-") for t in mtp_types)
    pattern = parse_pattern(main + f"/{mtp_part}" * depths)
    for name, allowed in (
        ("mlp_hidden_act", ["relu2"]),
        ("mamba_hidden_act", ["silu"]),
        ("attention_bias", [False]),
        ("mlp_bias", [False]),
        ("use_bias", [False]),
        ("mamba_proj_bias", [False]),
        ("use_conv_bias", [True]),
        ("norm_topk_prob", [True]),
        ("sliding_window", [None]),
        ("moe_latent_size", [None]),
    ):
        r.expect(name, allowed, allowed[0], " (megatron-core's hybrid layers have no other form)")
    r.expect("conv_kernel", [4], 4, " (megatron_hybrid builds Mamba with a width-4 conv)")
    hidden = int(r.require("hidden_size"))
    heads = int(r.require("num_attention_heads"))
    eps = float(r.get("layer_norm_epsilon", 1e-5))
    time_step_min = float(r.get("time_step_min", 0.001))
    kwargs = dict(
        num_layers=pattern.physical_layer_count,
        mtp_num_layers=depths or None,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(r.get("num_key_value_heads") or heads),
        kv_channels=int(r.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(r.require("intermediate_size")),
        normalization="RMSNorm",
        layernorm_epsilon=eps,
        gated_linear_unit=False,
        activation_func=squared_relu,
        add_bias_linear=False,
        add_qkv_bias=False,
        attention_dropout=float(r.get("attention_dropout", 0.0) or 0.0),
        hidden_dropout=float(r.get("hidden_dropout", 0.0) or 0.0),
        mamba_state_dim=int(r.require("ssm_state_size")),
        mamba_head_dim=int(r.require("mamba_head_dim")),
        mamba_num_groups=int(r.require("n_groups")),
        mamba_num_heads=int(r.require("mamba_num_heads")),
    )
    if pattern.layer_counts.get(MOE):
        kwargs.update(
            num_moe_experts=int(r.require("n_routed_experts")),
            moe_router_topk=int(r.require("num_experts_per_tok")),
            moe_ffn_hidden_size=int(r.require("moe_intermediate_size")),
            moe_shared_expert_intermediate_size=int(
                r.require("moe_shared_expert_intermediate_size")
            ),
            **sigmoid_router(r),
        )
    else:
        for name in (
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "routed_scaling_factor",
            "n_group",
            "topk_group",
        ):
            r.get(name)
    if pattern.layer_counts.get(MAMBA) and eps != MEGATRON_GATED_NORM_EPS:
        notes.append(
            f"layer_norm_epsilon {eps:g} is also Mamba's gated-norm epsilon in transformers; the "
            "torch Mamba2 path uses it, megatron-core's MambaMixer (mamba_impl='kernels') "
            f"hard-codes {MEGATRON_GATED_NORM_EPS:g}"
        )
    if pattern.layer_counts.get(MAMBA) and time_step_min > 0:
        notes.append(
            f"transformers clamps Mamba's step size from below at time_step_min "
            f"({time_step_min:g}); the torch Mamba2 path does too, megatron-core's MambaMixer "
            "(mamba_impl='kernels') does not, so its outputs differ wherever the step is smaller"
        )
    model_kwargs = dict(
        vocab_size=int(r.require("vocab_size")),
        max_sequence_length=int(r.get("max_position_embeddings", 4096)),
        position_embedding_type="none",
        share_embeddings_and_output_weights=bool(r.get("tie_word_embeddings", False)),
    )
    return HFConversion(
        family="nemotron_h",
        hf_config=hf,
        config_kwargs=kwargs,
        mla=False,
        pattern=pattern,
        model_kwargs=model_kwargs,
        hf_prefix="backbone.",
        dtype=r.dtype(),
        mtp_layers=depths,
        unsupported=r.finish(),
        notes=notes,
        mamba_mixer_params=dict(dt_limit=(time_step_min, float("inf")), norm_eps=eps),
    )


def _norm(b: PlanBuilder, p: str, h: str, *suffixes: str) -> None:
    b.copy(b.key(p, *suffixes), f"{h}norm.weight")


def _mamba(b: PlanBuilder, p: str, h: str, c: dict) -> None:
    _norm(b, p, h, "norm.weight", "mixer.in_proj.layer_norm_weight")
    m, a = f"{p}mixer.", f"{h}mixer."
    inner = c["mamba_num_heads"] * c["mamba_head_dim"]
    bc = c["mamba_num_groups"] * c["mamba_state_dim"]
    b.split(
        f"{a}in_proj.weight",
        [
            (b.key(m, f"in_proj.weight.{name}"), rows)
            for name, rows in (
                ("z", inner),
                ("x", inner),
                ("B", bc),
                ("C", bc),
                ("dt", c["mamba_num_heads"]),
            )
        ],
    )
    for tensor in ("weight", "bias"):
        parts = (("x", inner), ("B", bc), ("C", bc))
        b.split(f"{a}conv1d.{tensor}", [(b.key(m, f"conv1d.{tensor}.{n}"), k) for n, k in parts])
    for name in ("A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"):
        b.copy(b.key(m, name), f"{a}{name}")


def _attention(b: PlanBuilder, p: str, h: str, c: dict) -> None:
    s = f"{p}self_attention."
    _norm(b, p, h, "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
    qkv_interleave(
        b,
        b.key(s, "linear_qkv.weight"),
        f"{h}mixer.",
        heads=c["num_attention_heads"],
        groups=c["num_query_groups"],
        head_dim=c["kv_channels"],
        hidden=c["hidden_size"],
        output_gate=False,
    )
    b.copy(b.key(s, "linear_proj.weight"), f"{h}mixer.o_proj.weight")


def _mlp(b: PlanBuilder, key_prefix: str, hf_prefix: str) -> None:
    b.copy(b.key(key_prefix, "linear_fc1.weight"), f"{hf_prefix}up_proj.weight")
    b.copy(b.key(key_prefix, "linear_fc2.weight"), f"{hf_prefix}down_proj.weight")


def _dense(b: PlanBuilder, p: str, h: str, c: dict) -> None:
    _norm(b, p, h, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
    _mlp(b, f"{p}mlp.", f"{h}mixer.")


def _moe(b: PlanBuilder, p: str, h: str, c: dict) -> None:
    _norm(b, p, h, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
    gate = f"{h}mixer.gate."
    b.copy(b.key(p, "mlp.router.weight"), f"{gate}weight")
    b.copy(b.key(p, "mlp.router.expert_bias"), f"{gate}e_score_correction_bias")
    b.fp32(f"{gate}e_score_correction_bias")
    routed_experts(b, p, f"{h}mixer.", c["num_moe_experts"], c["moe_ffn_hidden_size"], False)
    _mlp(b, f"{p}mlp.shared_experts.", f"{h}mixer.shared_experts.")


#: Pattern symbol -> the block's links (a registry, not a branch per symbol).
_BLOCKS = {"M": _mamba, "*": _attention, "-": _dense, "E": _moe}


def _plan(b: PlanBuilder, conversion: HFConversion) -> None:
    c = conversion.config_kwargs
    pattern = conversion.pattern
    prefix = conversion.hf_prefix
    b.copy(b.key("", "embedding.word_embeddings.weight"), f"{prefix}embeddings.weight")
    for layer in pattern.logical_layers:
        symbol = layer.members[0]
        _BLOCKS[symbol](b, f"decoder.layers.{layer.index}.", f"{prefix}layers.{layer.index}.", c)
    b.copy(b.key(final_norm_prefix(pattern), "weight"), f"{prefix}norm_f.weight")
    if not conversion.model_kwargs["share_embeddings_and_output_weights"]:
        b.copy(b.key("", "output_layer.weight"), "lm_head.weight")
    per_depth = len(pattern.mtp_items)
    for depth in range(pattern.mtp_num_depths):
        p = f"mtp.layers.{depth}."
        first, last = (
            f"mtp.layers.{depth * per_depth}.",
            f"mtp.layers.{(depth + 1) * per_depth - 1}.",
        )
        for name in ("enorm", "hnorm", "eh_proj"):
            b.copy(b.key(p, f"{name}.weight"), f"{first}{name}.weight")
        for i, symbol in enumerate(pattern.mtp_items):
            inner = mtp_layer_prefix(depth, i, pattern)
            _BLOCKS[symbol](b, inner, f"mtp.layers.{depth * per_depth + i}.", c)
        b.copy(
            b.key(p, "final_layernorm.weight", "layer_norm.weight"),
            f"{last}final_layernorm.weight",
        )


def _to_hf_config(conversion: HFConversion) -> dict:
    c = conversion.config_kwargs
    pattern = conversion.pattern
    params = conversion.mamba_mixer_params
    out = dict(
        model_type="nemotron_h",
        architectures=["NemotronHForCausalLM"],
        vocab_size=conversion.model_kwargs["vocab_size"],
        hidden_size=c["hidden_size"],
        layers_block_type=[_TYPE[layer.members[0]] for layer in pattern.logical_layers],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_query_groups"],
        head_dim=c["kv_channels"],
        intermediate_size=c["ffn_hidden_size"],
        mlp_hidden_act="relu2",
        mamba_hidden_act="silu",
        ssm_state_size=c["mamba_state_dim"],
        mamba_num_heads=c["mamba_num_heads"],
        mamba_head_dim=c["mamba_head_dim"],
        n_groups=c["mamba_num_groups"],
        conv_kernel=4,
        time_step_min=params["dt_limit"][0],
        use_conv_bias=True,
        use_bias=False,
        mlp_bias=False,
        attention_bias=False,
        mamba_proj_bias=False,
        layer_norm_epsilon=c["layernorm_epsilon"],
        max_position_embeddings=conversion.model_kwargs["max_sequence_length"],
        tie_word_embeddings=conversion.model_kwargs["share_embeddings_and_output_weights"],
        num_nextn_predict_layers=conversion.mtp_layers,
        dtype=dtype_name(conversion.dtype),
    )
    if conversion.mtp_layers:
        out["mtp_layers_block_type"] = [_TYPE[s] for s in pattern.mtp_items]
    if c.get("num_moe_experts"):
        out.update(
            n_routed_experts=c["num_moe_experts"],
            num_experts_per_tok=c["moe_router_topk"],
            moe_intermediate_size=c["moe_ffn_hidden_size"],
            moe_shared_expert_intermediate_size=c["moe_shared_expert_intermediate_size"],
            n_group=c.get("moe_router_num_groups") or 1,
            topk_group=c.get("moe_router_group_topk") or 1,
            routed_scaling_factor=c["moe_router_topk_scaling_factor"],
            norm_topk_prob=True,
        )
    source = {k: v for k, v in conversion.hf_config.items() if k not in out}
    # The legacy spellings would override the list on load; the list says the same.
    for legacy in ("hybrid_override_pattern", "mtp_hybrid_override_pattern"):
        source.pop(legacy, None)
    return {**out, **source}


NEMOTRON_H = Family(
    name="nemotron_h",
    model_types=("nemotron_h",),
    to_megatron=_to_megatron,
    plan=_plan,
    to_hf_config=_to_hf_config,
    text_prefixes=("backbone.", "model."),
    # NemotronHForCausalLM's backbone attribute is ``model`` (transformers 5.23,
    # modeling_nemotron_h.py); save_pretrained writes it as ``backbone.``.
    module_prefix="model.",
)
register_family(NEMOTRON_H)

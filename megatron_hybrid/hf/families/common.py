"""Pieces shared by the family tables: RoPE fields, MoE experts, gated MLPs, attention QKV."""

from __future__ import annotations

from megatron_hybrid.hf.config import ConfigReader
from megatron_hybrid.hf.plan import PlanBuilder

__all__ = ["gated_mlp", "qkv_interleave", "rope_fields", "routed_experts", "sigmoid_router"]


def rope_fields(reader: ConfigReader, allowed_types=("default",)) -> dict:
    """RoPE settings from ``rope_parameters`` (transformers 5) or the legacy top-level fields.

    Returns a dict with ``rope_type``, ``rope_theta``, ``partial_rotary_factor`` and the
    type's own parameters; unsupported types are recorded on ``reader``.
    """
    params = dict(reader.get("rope_parameters") or {})
    legacy = reader.get("rope_scaling") or {}
    for name in ("rope_theta", "partial_rotary_factor"):
        if name not in params and reader.config.get(name) is not None:
            params[name] = reader.get(name)
        reader.used.add(name)
    params.update({k: v for k, v in legacy.items() if k not in params})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    params["rope_type"] = rope_type
    if rope_type not in allowed_types:
        reader.unsupported.append(
            ("rope_parameters", f"rope_type {rope_type!r} is not supported ({allowed_types!r})")
        )
    params.setdefault("rope_theta", 10000.0)
    params.setdefault("partial_rotary_factor", 1.0)
    return params


def gated_mlp(
    b: PlanBuilder, key_prefix: str, hf_prefix: str, rows: int, expert: int | None = None
) -> None:
    """``linear_fc1 = [gate_proj; up_proj]``, ``linear_fc2 = down_proj`` (SwiGLU MLP)."""
    fc1 = b.key(key_prefix, "linear_fc1.weight")
    fc2 = b.key(key_prefix, "linear_fc2.weight")
    b.concat(
        fc1, [(f"{hf_prefix}gate_proj.weight", rows), (f"{hf_prefix}up_proj.weight", rows)], expert
    )
    b.copy(fc2, f"{hf_prefix}down_proj.weight", expert)


def routed_experts(
    b: PlanBuilder, key_prefix: str, hf_prefix: str, num_experts: int, rows: int, gated: bool = True
) -> None:
    """Routed experts, one HF tensor set per expert (the on-disk, per-expert layout).

    In memory transformers 5 holds them as ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
    first; ``experts.up_proj`` without a gate) and ``experts.down_proj`` ``[E, H, I]``, in that
    registration order (``modeling_*``: the experts classes' ``__init__``).
    """
    fc1 = b.key(key_prefix, "mlp.experts.experts.linear_fc1.weight")
    fc2 = b.key(key_prefix, "mlp.experts.experts.linear_fc2.weight")
    b.experts(fc1, f"{hf_prefix}experts", "gate_up_proj" if gated else "up_proj", 0)
    b.experts(fc2, f"{hf_prefix}experts", "down_proj", 1)
    for e in range(num_experts):
        name = f"{hf_prefix}experts.{e}."
        if gated:
            b.concat(fc1, [(f"{name}gate_proj.weight", rows), (f"{name}up_proj.weight", rows)], e)
        else:
            b.copy(fc1, f"{name}up_proj.weight", e)
        b.copy(fc2, f"{name}down_proj.weight", e)


def qkv_interleave(
    b: PlanBuilder,
    key: str | None,
    hf_prefix: str,
    *,
    heads: int,
    groups: int,
    head_dim: int,
    hidden: int,
    output_gate: bool,
) -> None:
    """megatron's ``linear_qkv`` rows: per query group ``[q heads; gate heads; k; v]``.

    ``q_proj`` holds per head ``[q_h; gate_h]`` when the attention has an output gate (Qwen3.5,
    Qwen3-Next), else ``q_h``; ``k_proj``/``v_proj`` one head per group.
    """
    q, k, v = (f"{hf_prefix}{n}_proj.weight" for n in "qkv")
    q_width = 2 * head_dim if output_gate else head_dim
    b.hf(q, (heads * q_width, hidden))
    b.hf(k, (groups * head_dim, hidden))
    b.hf(v, (groups * head_dim, hidden))
    per_group = heads // groups
    start = 0
    for g in range(groups):
        heads_of_g = range(g * per_group, (g + 1) * per_group)
        q_rows = [h * q_width + i for h in heads_of_g for i in range(head_dim)]
        b.gather(key, q, q_rows, start)
        start += len(q_rows)
        if output_gate:
            gate_rows = [h * q_width + head_dim + i for h in heads_of_g for i in range(head_dim)]
            b.gather(key, q, gate_rows, start)
            start += len(gate_rows)
        for name in (k, v):
            b.gather(key, name, range(g * head_dim, (g + 1) * head_dim), start)
            start += head_dim


def sigmoid_router(reader: ConfigReader) -> dict:
    """``TransformerConfig`` fields of DeepSeek-V3's router (also Nemotron-H's).

    Sigmoid scores, top-k chosen on ``scores + e_score_correction_bias`` (an fp32 expert bias)
    within the ``topk_group`` best of ``n_group`` groups, renormalised and scaled by
    ``routed_scaling_factor``; no auxiliary loss (the bias balances the load).
    """
    groups = reader.get("n_group")
    grouped = bool(groups) and int(groups) > 1
    top_groups = reader.get("topk_group")
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=int(groups) if grouped else None,
        moe_router_group_topk=int(top_groups) if grouped else None,
        moe_router_topk_scaling_factor=float(reader.get("routed_scaling_factor", 1.0) or 1.0),
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
    )

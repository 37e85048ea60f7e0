"""megatron_hybrid.peft at TP1 against peft 0.21 on the transformers model: logits, the PEFT
folder both ways, the merged stream, and the negative controls the comparison must catch."""

from __future__ import annotations

import json
import shutil

import hf_oracle
import peft_oracle
import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_hybrid.hf import iter_hf_weights, load_hf_model
from megatron_hybrid.peft import (
    PeftAdapterError,
    iter_lora_weights,
    load_peft_adapter,
    lora_config_dict,
    save_peft_adapter,
)

FAMILIES = pytest.mark.parametrize("family", peft_oracle.FAMILIES)
REL_L2 = 1e-4  # logits' relative L2 error: 100x the rounding of the well-conditioned families
WEIGHTS = "adapter_model.safetensors"


def logits_of(model, input_ids):
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    model.eval()
    with torch.no_grad():
        return model(input_ids, positions, None)


def errors(ours, reference) -> tuple[float, float]:
    diff = ours - reference
    return diff.abs().max().item(), (diff.norm() / reference.norm()).item()


def adapted(case, folder=None):
    model = load_hf_model(case.hf)
    return load_peft_adapter(model, folder or case.adapter)


@FAMILIES
def test_peft_adapter_gives_peft_logits(family, cases, input_ids, pg):
    case = cases[family]
    # The adapter matters (else the comparison proves nothing).
    assert (case.logits - case.base_logits).abs().max().item() > 0.5
    max_abs, rel = errors(logits_of(adapted(case), input_ids), case.logits)
    assert max_abs <= case.bound and rel <= REL_L2, (max_abs, case.bound, rel)


@FAMILIES
def test_saved_folder_is_peft_file_bitwise_and_reloads(family, cases, input_ids, pg, tmp_path):
    case = cases[family]
    model = adapted(case)
    save_peft_adapter(model, tmp_path / "ours")
    theirs, ours = load_file(case.adapter / WEIGHTS), load_file(tmp_path / "ours" / WEIGHTS)
    assert set(ours) == set(theirs) and len(ours) == case.tensors
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    streamed = dict(iter_lora_weights(model))
    assert set(streamed) == set(ours)
    assert all(torch.equal(streamed[n], ours[n]) for n in ours)
    reloaded, live = peft_oracle.peft_logits(case.hf, tmp_path / "ours", input_ids)
    assert live == case.tensors  # no tensor silently dropped by PEFT
    assert torch.equal(reloaded, case.logits)
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["r"] == peft_oracle.RANK and config["lora_alpha"] == peft_oracle.ALPHA
    assert config["lora_dropout"] == 0.0


@FAMILIES
def test_merged_stream_is_merge_and_unload(family, cases, pg):
    case = cases[family]
    model = adapted(case)
    base = hf_oracle.read_tensors(case.hf)
    merged = list(iter_hf_weights(model, merge_lora=True))
    plain = list(iter_hf_weights(model, merge_lora=False))
    assert [n for n, _ in merged] == [n for n, _ in plain]  # same names, same order
    assert {n for n, _ in merged} == set(case.merged) == set(base)
    changed = 0
    for name, tensor in merged:
        assert tensor.dtype == base[name].dtype, name
        assert (tensor - case.merged[name]).abs().max().item() <= 1e-5, name
        if torch.equal(case.merged[name], base[name]):
            assert torch.equal(tensor, base[name]), name  # untouched tensors stay bitwise
        else:
            changed += 1
    assert changed > 0


def test_merge_without_adapters_is_refused(cases, pg):
    model = load_hf_model(cases["qwen3_5"].hf)
    with pytest.raises(ValueError, match="no weight of the model has a LoRA adapter"):
        next(iter_hf_weights(model, merge_lora=True))


def test_streaming_an_adapted_model_needs_a_choice(cases, pg):
    """merge_lora must be said for a model with adapters: True merges, False sends the base."""
    case = cases["qwen3_5"]
    model = adapted(case)
    with pytest.raises(ValueError, match="has LoRA adapters.*merge_lora=True.*merge_lora=False"):
        next(iter_hf_weights(model))
    base = hf_oracle.read_tensors(case.hf)
    plain = dict(iter_hf_weights(model, merge_lora=False))
    assert set(plain) == set(base) and all(torch.equal(plain[n], base[n]) for n in base)
    merged = dict(iter_hf_weights(model, merge_lora=True))
    assert any(not torch.equal(merged[n], base[n]) for n in base)
    assert set(dict(iter_hf_weights(load_hf_model(case.hf)))) == set(base)  # no adapters: fine


# --- negative controls: what a loader or exporter with each bug computes --------------------


def _corrupt(case, tmp_path, edit) -> object:
    folder = tmp_path / "corrupt"
    shutil.copytree(case.adapter, folder)
    tensors = load_file(folder / WEIGHTS)
    edit(tensors)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    return folder


def _experts(tensors, which="base_layer."):
    a = next(n for n in tensors if n.endswith(f"layers.0.mlp.experts.{which}lora_A.weight"))
    return a, a.replace("lora_A", "lora_B")


def _swap_experts(tensors):
    a, b = _experts(tensors)
    r = peft_oracle.RANK
    rows = tensors[a].clone()
    rows[:r], rows[r : 2 * r] = tensors[a][r : 2 * r], tensors[a][:r]
    tensors[a] = rows
    experts = tensors[a].shape[0] // r
    cols = tensors[b].reshape(tensors[b].shape[0], r, experts).clone()
    cols[:, :, [0, 1]] = cols[:, :, [1, 0]]
    tensors[b] = cols.reshape(tensors[b].shape)


def _expert_major_b(tensors):
    _, b = _experts(tensors)
    r = peft_oracle.RANK
    out, width = tensors[b].shape
    experts = width // r
    per = tensors[b].reshape(out, r, experts).permute(0, 2, 1)  # [out, E, r]
    tensors[b] = per.reshape(out, width).contiguous()  # read back as rank-major: wrong


def _swap_gate_up(tensors):
    _, b = _experts(tensors)
    half = tensors[b].shape[0] // 2
    tensors[b] = torch.cat([tensors[b][half:], tensors[b][:half]])


def _flat_gated_q(tensors):
    """q_proj's B rows as [q of all heads; gate of all heads] instead of per head."""
    name = next(n for n in tensors if n.endswith("self_attn.q_proj.lora_B.weight"))
    head_dim = 16
    heads = tensors[name].shape[0] // (2 * head_dim)
    per_head = tensors[name].reshape(heads, 2, head_dim, -1)
    tensors[name] = per_head.transpose(0, 1).reshape(tensors[name].shape).contiguous()


def _flat_gdn(tensors):
    """Qwen3-Next's in_proj_qkvz B rows split flat instead of per key head."""
    name = next(n for n in tensors if n.endswith("linear_attn.in_proj_qkvz.lora_B.weight"))
    key_heads = 2
    grouped = tensors[name].reshape(key_heads, -1, tensors[name].shape[1])
    tensors[name] = grouped.transpose(0, 1).reshape(tensors[name].shape).contiguous()


CONTROLS = {
    "swapped_experts": ("qwen3_5_moe", _swap_experts),
    "expert_major_b": ("qwen3_5_moe", _expert_major_b),
    "gate_up_swapped": ("qwen3_5_moe", _swap_gate_up),
    "flat_gated_q": ("qwen3_5", _flat_gated_q),
    "flat_head_grouped_gdn": ("qwen3_next", _flat_gdn),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_negative_controls_move_logits(control, cases, input_ids, pg, tmp_path):
    family, edit = CONTROLS[control]
    case = cases[family]
    folder = _corrupt(case, tmp_path, edit)
    max_abs, _ = errors(logits_of(adapted(case, folder), input_ids), case.logits)
    # Far outside the bound the oracle test holds (the smallest, one gated-attention layer's
    # q rows, moves the logits by 0.08).
    assert max_abs > 10 * case.bound, (max_abs, case.bound)


def test_transposed_expert_layout_fails_on_shape(cases, pg, tmp_path):
    """peft 0.18's ``[E, in, out]``-style layout: refused by shape, since 2I != hidden."""
    case = cases["qwen3_5_moe"]

    def transpose(tensors):
        a, b = _experts(tensors)
        tensors[a], tensors[b] = tensors[b].t().contiguous(), tensors[a].t().contiguous()

    folder = _corrupt(case, tmp_path, transpose)
    with pytest.raises(PeftAdapterError, match="has shape"):
        adapted(case, folder)


def test_unknown_tensor_is_refused(cases, pg, tmp_path):
    case = cases["qwen3_5"]

    def extra(tensors):
        tensors["base_model.model.model.layers.0.mlp.gate.lora_A.weight"] = torch.zeros(4, 64)

    with pytest.raises(PeftAdapterError, match="name no adaptable piece"):
        adapted(case, _corrupt(case, tmp_path, extra))


def test_half_an_adapter_is_refused(cases, pg, tmp_path):
    case = cases["qwen3_5"]

    def drop(tensors):
        del tensors[next(n for n in tensors if n.endswith("o_proj.lora_B.weight"))]

    with pytest.raises(PeftAdapterError, match="without its partner"):
        adapted(case, _corrupt(case, tmp_path, drop))


@pytest.mark.parametrize(
    "field, value", [("use_dora", True), ("rank_pattern", {"q_proj": 8}), ("bias", "all")]
)
def test_unsupported_config_is_refused(field, value, cases, pg, tmp_path):
    case = cases["qwen3_5"]
    folder = tmp_path / "cfg"
    shutil.copytree(case.adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config[field] = value
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(PeftAdapterError, match=field):
        adapted(case, folder)


def test_config_names_every_adapted_module(cases, pg):
    config = lora_config_dict(adapted(cases["qwen3_next"]))
    assert "gate_proj" not in config["target_modules"]  # PEFT would drop them (qwen2_moe rule)
    assert {"gate_proj.weight", "up_proj.weight", "down_proj.weight"} <= set(
        config["target_parameters"]
    )
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(config["target_parameters"])

"""megatron_hybrid.hf at TP1 against transformers: logits, streamed export, refusals, controls."""

from __future__ import annotations

import dataclasses
import json
import shutil

import hf_oracle
import pytest
import torch
from hf_oracle import CONVERTED, TOLERANCE

from megatron_hybrid.hf import (
    HFConfigError,
    dry_run,
    iter_hf_weights,
    load_hf_model,
)
from megatron_hybrid.hf import weights as hf_weights
from megatron_hybrid.hf.plan import Link


def _logits(model, input_ids):
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    model.eval()
    with torch.no_grad():
        return model(input_ids, positions, None)


@pytest.mark.parametrize("family", CONVERTED)
def test_logits_match_transformers(family, hf_folders, input_ids, pg):
    folder, reference, bound = hf_folders[family]
    logits = _logits(load_hf_model(folder), input_ids)
    assert logits.shape == reference.shape
    assert (logits - reference).abs().max().item() <= bound


@pytest.mark.parametrize("family", CONVERTED)
def test_export_is_the_checkpoint_bitwise(family, hf_folders, pg):
    folder = hf_folders[family][0]
    disk = hf_oracle.read_tensors(folder)
    exported = dict(iter_hf_weights(load_hf_model(folder)))
    assert list(exported) == [n for n in exported]  # a dict of unique names
    assert set(exported) == set(disk)
    for name, tensor in disk.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


def _swap_experts(plan):
    def swap(link):
        if link.expert in (0, 1):
            return dataclasses.replace(link, expert=1 - link.expert)
        return link

    return [swap(link) for link in plan.links]


def _swap_gate_up(plan):
    out = []
    for link in plan.links:
        if link.key.endswith("shared_experts.linear_fc1.weight"):
            half = link.key_rows.stop - link.key_rows.start
            start = half if link.key_rows.start == 0 else 0
            link = dataclasses.replace(link, key_rows=slice(start, start + half))
        out.append(link)
    return out


def _plain_qkv(plan):
    """linear_qkv as all of q_proj, then k_proj, then v_proj (no per-group interleave)."""
    qkv = [link for link in plan.links if link.key.endswith("linear_qkv.weight")]
    result = [link for link in plan.links if not link.key.endswith("linear_qkv.weight")]
    for key in dict.fromkeys(link.key for link in qkv):
        position = 0
        for part in ("q_proj", "k_proj", "v_proj"):
            links = [x for x in qkv if x.key == key and x.hf_name.endswith(f"{part}.weight")]
            rows = tuple(sorted(r for link in links for r in link.hf_rows))
            result.append(Link(key, slice(position, position + len(rows)), links[0].hf_name, rows))
            position += len(rows)
    return result


def _flat_gdn_split(plan):
    """Qwen3-Next's head-grouped in_proj_qkvz read as if it were flat [q; k; v; z]."""
    out, offsets = [], {}
    for link in plan.links:
        if link.hf_name.endswith("in_proj_qkvz.weight"):
            start = offsets.get(link.hf_name, 0)
            rows = len(link.hf_rows)
            link = dataclasses.replace(link, hf_rows=slice(start, start + rows))
            offsets[link.hf_name] = start + rows
        out.append(link)
    return out


@pytest.mark.parametrize(
    "bug",
    [_plain_qkv, _flat_gdn_split, _swap_gate_up, _swap_experts],
    ids=["qkv-not-interleaved", "gdn-in-proj-flat", "shared-fc1-up-gate", "experts-0-1-swapped"],
)
def test_negative_controls_move_logits(bug, hf_folders, input_ids, pg, monkeypatch):
    """Each single mapping bug moves the logits far outside the bound the layout tests use."""
    folder, reference, bound = hf_folders["qwen3_next"]
    build = hf_weights.build_plan

    def buggy(conversion, key_shapes, family=None):
        plan, unresolved = build(conversion, key_shapes, family)
        return dataclasses.replace(plan, links=bug(plan)), unresolved

    monkeypatch.setattr(hf_weights, "build_plan", buggy)
    logits = _logits(load_hf_model(folder), input_ids)
    assert (logits - reference).abs().max().item() > max(100 * bound, 1000 * TOLERANCE)


def _edit_config(folder, tmp_path, **changes):
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize(
    ("family", "changes", "field"),
    [
        ("qwen3_5_moe", {"sliding_window_pattern": 3}, "sliding_window_pattern"),
        ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
        ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob"),
        ("qwen3_next", {"hidden_act": "gelu"}, "hidden_act"),
        ("deepseek_v3", {"qk_head_dim": 7}, "qk_head_dim"),
    ],
    ids=["unknown-field", "rope-not-interleaved", "no-topk-renorm", "activation", "derived-field"],
)
def test_config_fields_that_change_the_math_are_refused(
    family, changes, field, hf_folders, tmp_path, pg
):
    folder = _edit_config(hf_folders[family][0], tmp_path, **changes)
    with pytest.raises(HFConfigError, match=field):
        load_hf_model(folder)
    conversion, report = dry_run(folder)
    assert conversion is None
    assert [name for name, _ in report.unsupported_config] == [field]


def test_ignored_field_is_accepted_when_named(hf_folders, tmp_path, pg):
    folder = _edit_config(hf_folders["qwen3_5"][0], tmp_path, my_training_note="x")
    with pytest.raises(HFConfigError, match="my_training_note"):
        load_hf_model(folder)
    model = load_hf_model(folder, ignore_config_fields=["my_training_note"])
    assert model.hf_conversion.family == "qwen3_5"


def test_dry_run_lists_unused_and_missing_tensors(hf_folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "changed"
    shutil.copytree(hf_folders["qwen3_5"][0], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    del tensors["model.layers.3.self_attn.k_norm.weight"]
    tensors["model.layers.1.linear_attn.A_log"] = torch.zeros(5)
    save_file(tensors, folder / "model.safetensors")
    conversion, report = dry_run(folder)
    assert conversion is not None and not report.ok
    assert report.unused_hf == ["model.layers.0.extra.weight"]
    assert report.missing_hf == ["model.layers.3.self_attn.k_norm.weight"]
    assert [name for name, _ in report.shape_errors] == ["model.layers.1.linear_attn.A_log"]


def test_dry_run_of_a_clean_folder_is_ok(hf_folders):
    conversion, report = dry_run(hf_folders["qwen3_next"][0])
    assert report.ok, report.lines()
    assert conversion.pattern.pattern == "[GE][GE][GE][*E]"


def test_declared_mtp_without_weights_is_noted(tmp_path, pg):
    folder = hf_oracle.make_hf_checkpoint("qwen3_5", tmp_path / "q", mtp_layers=1)
    conversion, report = dry_run(folder)
    assert report.ok
    assert conversion.mtp_layers == 0
    assert any("MTP" in note for note in conversion.notes)


def test_hub_vlm_layout_converts_its_language_model(hf_folders, input_ids, tmp_path, pg):
    """The published Qwen3.5 checkpoints: text_config, tensors under model.language_model."""
    folder, reference, bound = hf_folders["qwen3_5_moe"]
    vlm = hf_oracle.to_vlm_layout(shutil.copytree(folder, tmp_path / "vlm"))
    conversion, report = dry_run(vlm)
    assert report.ok and conversion.hf_prefix == "model.language_model."
    model = load_hf_model(vlm)
    assert (_logits(model, input_ids) - reference).abs().max().item() <= bound
    disk = hf_oracle.read_tensors(vlm)
    exported = dict(iter_hf_weights(model))
    assert set(exported) == set(disk)
    assert all(torch.equal(exported[name], tensor) for name, tensor in disk.items())

"""Tests of the Hugging Face oracle itself: random values, hub layout, logits, sharding, MTP."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import hf_oracle as oracle  # tests/unit/hf is on sys.path (pytest's rootdir-less "prepend")
import pytest
import torch

FAMILIES = pytest.mark.parametrize("family", oracle.FAMILIES, ids=list(oracle.FAMILIES))
INPUT_IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))

# (on-disk tensors, in-memory state_dict entries) of the tiny models: save_pretrained splits the
# packed experts (1 packed pair -> 3 x 4 per-expert keys per MoE layer) and renames Nemotron-H.
KEY_COUNTS = {
    "qwen3_5": (56, 56),
    "qwen3_5_moe": (112, 72),
    "qwen3_next": (106, 66),
    "deepseek_v3": (67, 47),
    "nemotron_h": (33, 27),
}

# Hub-layout examples (name -> shape) that each checkpoint must hold, layer 0 and layer 3.
EXPECTED_KEYS: dict[str, dict[str, tuple[int, ...]]] = {
    "qwen3_5": {
        "model.layers.0.linear_attn.in_proj_qkv.weight": (128, 64),
        "model.layers.0.linear_attn.in_proj_z.weight": (64, 64),
        "model.layers.0.linear_attn.in_proj_b.weight": (4, 64),
        "model.layers.0.linear_attn.in_proj_a.weight": (4, 64),
        "model.layers.0.linear_attn.conv1d.weight": (128, 1, 4),
        "model.layers.0.linear_attn.norm.weight": (16,),
        "model.layers.0.mlp.gate_proj.weight": (96, 64),
        "model.layers.3.self_attn.q_proj.weight": (128, 64),
        "model.layers.3.self_attn.q_norm.weight": (16,),
        "model.layers.3.mlp.down_proj.weight": (64, 96),
        "model.embed_tokens.weight": (256, 64),
        "lm_head.weight": (256, 64),
    },
    "qwen3_5_moe": {
        "model.layers.0.linear_attn.in_proj_qkv.weight": (128, 64),
        "model.layers.0.mlp.gate.weight": (4, 64),
        "model.layers.0.mlp.experts.0.gate_proj.weight": (32, 64),
        "model.layers.0.mlp.experts.3.up_proj.weight": (32, 64),
        "model.layers.0.mlp.experts.3.down_proj.weight": (64, 32),
        "model.layers.0.mlp.shared_expert.gate_proj.weight": (48, 64),
        "model.layers.0.mlp.shared_expert_gate.weight": (1, 64),
        "model.layers.3.self_attn.q_proj.weight": (128, 64),
        "model.layers.3.self_attn.k_proj.weight": (32, 64),
    },
    "qwen3_next": {
        "model.layers.0.linear_attn.in_proj_qkvz.weight": (192, 64),
        "model.layers.0.linear_attn.in_proj_ba.weight": (8, 64),
        "model.layers.0.linear_attn.conv1d.weight": (128, 1, 4),
        "model.layers.0.mlp.experts.2.gate_proj.weight": (32, 64),
        "model.layers.0.mlp.shared_expert.down_proj.weight": (64, 48),
        "model.layers.3.self_attn.q_proj.weight": (128, 64),
        "model.layers.3.self_attn.k_norm.weight": (16,),
    },
    "deepseek_v3": {
        "model.layers.0.mlp.gate_proj.weight": (96, 64),
        "model.layers.0.self_attn.q_a_proj.weight": (32, 64),
        "model.layers.0.self_attn.q_b_proj.weight": (96, 32),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (24, 64),
        "model.layers.0.self_attn.kv_b_proj.weight": (128, 16),
        "model.layers.1.mlp.gate.weight": (4, 64),
        "model.layers.1.mlp.gate.e_score_correction_bias": (4,),
        "model.layers.2.mlp.experts.3.down_proj.weight": (64, 32),
        "model.layers.2.mlp.shared_experts.gate_proj.weight": (32, 64),
    },
    "nemotron_h": {
        "backbone.embeddings.weight": (256, 64),
        "backbone.norm_f.weight": (64,),
        "backbone.layers.0.mixer.in_proj.weight": (328, 64),
        "backbone.layers.0.mixer.conv1d.weight": (192, 1, 4),
        "backbone.layers.0.mixer.conv1d.bias": (192,),
        "backbone.layers.0.mixer.norm.weight": (128,),
        "backbone.layers.0.mixer.D": (8,),
        "backbone.layers.1.mixer.gate.e_score_correction_bias": (4,),
        "backbone.layers.1.mixer.experts.3.up_proj.weight": (32, 64),
        "backbone.layers.1.mixer.shared_experts.down_proj.weight": (64, 48),
        "backbone.layers.2.mixer.q_proj.weight": (64, 64),
        "backbone.layers.3.mixer.up_proj.weight": (96, 64),
        "lm_head.weight": (256, 64),
    },
}

MODEL_TYPES = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_next": "qwen3_next",
    "deepseek_v3": "deepseek_v3",
    "nemotron_h": "nemotron_h",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One float32 single-file checkpoint per family (seed 0)."""
    root = tmp_path_factory.mktemp("hf")
    return {f: oracle.make_hf_checkpoint(f, root / f) for f in oracle.FAMILIES}


def _default_init(family: str) -> torch.nn.Module:
    """The same tiny model with transformers' own initialisation."""
    module = oracle.modeling_module(family)
    torch.manual_seed(123)
    return getattr(module, oracle._CLASSES[family][2])._from_config(oracle.tiny_config(family))


@FAMILIES
def test_every_tensor_is_randomised(family, checkpoints):
    model = oracle.build_model(family)
    default = _default_init(family)
    tensors = dict(default.named_parameters()) | dict(default.named_buffers())
    ours = dict(model.named_parameters()) | dict(model.named_buffers())
    assert ours.keys() == tensors.keys()
    for name, value in ours.items():
        if name.rsplit(".", 1)[-1] in oracle.DERIVED_BUFFERS:
            # RoPE constants must stay what transformers derives from the config.
            assert torch.equal(value, tensors[name]), name
        else:
            assert not torch.allclose(value, tensors[name]), f"{name} still at HF's init"

    for name, value in oracle.read_tensors(checkpoints[family]).items():
        flat = value.float().flatten()
        # Identity norms (all ones), zero-centred norms and zero router biases are constants.
        assert flat.std() > 0.01, f"{name} is (nearly) constant: std {flat.std():.3g}"
        if value.dim() >= 2:
            # HF inits matrices (routers included) with std 0.02; ours have std 1/sqrt(fan_in).
            assert flat.std() > 0.5 / math.sqrt(value.shape[-1]), f"{name} looks like HF's init"


@FAMILIES
def test_logits_are_finite_deterministic_and_those_of_the_saved_model(family, checkpoints):
    first = oracle.hf_logits(checkpoints[family], INPUT_IDS)
    second = oracle.hf_logits(checkpoints[family], INPUT_IDS)
    assert first.shape == (2, 24, 256) and first.dtype == torch.float32
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)
    # from_pretrained re-initialises tensors it cannot find: equality with the in-memory model
    # that was saved proves every tensor made the round trip through the on-disk names.
    with torch.no_grad():
        direct = oracle.build_model(family)(input_ids=INPUT_IDS, use_cache=False).logits
    assert torch.equal(first, direct)
    assert first.std() > 0.3  # not a degenerate (near-constant) model


@FAMILIES
def test_on_disk_names_are_the_hub_layout(family, checkpoints):
    path = checkpoints[family]
    disk = oracle.on_disk_tensors(path)
    memory = oracle.build_model(family).state_dict()
    assert (len(disk), len(memory)) == KEY_COUNTS[family]
    for name, shape in EXPECTED_KEYS[family].items():
        assert name in disk, f"{name} missing from the saved checkpoint"
        assert disk[name][1] == shape, name
    assert all(dtype == torch.float32 for dtype, _ in disk.values())
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in disk)
    assert json.loads((path / "config.json").read_text())["model_type"] == MODEL_TYPES[family]
    if family == "nemotron_h":
        assert all(k.startswith("backbone.") for k in disk if k != "lm_head.weight")
        assert all(k.startswith("model.") for k in memory if k != "lm_head.weight")
    if KEY_COUNTS[family][0] != KEY_COUNTS[family][1]:
        assert set(disk) != set(memory)


@FAMILIES
def test_sharded_save_writes_an_index_with_the_same_tensors(family, checkpoints, tmp_path):
    sharded = oracle.make_hf_checkpoint(family, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    single = oracle.read_tensors(checkpoints[family])
    split = oracle.read_tensors(sharded)
    assert single.keys() == split.keys()
    assert all(torch.equal(single[k], split[k]) for k in single)


@pytest.mark.parametrize("family", ["deepseek_v3", "nemotron_h"], ids=["deepseek_v3", "nemotron_h"])
def test_bf16_checkpoint_keeps_the_router_bias_float32(family, checkpoints, tmp_path):
    path = oracle.make_hf_checkpoint(family, tmp_path / "bf16", dtype=torch.bfloat16)
    disk = oracle.on_disk_tensors(path)
    bias = {k for k in disk if k.endswith("e_score_correction_bias")}
    assert bias and all(disk[k][0] == torch.float32 for k in bias)
    assert all(dt == torch.bfloat16 for k, (dt, _) in disk.items() if k not in bias)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    fp32 = oracle.read_tensors(checkpoints[family])
    bf16 = oracle.read_tensors(path)
    for name in disk:  # same seed: the same model, rounded (the fp32 bias not at all)
        assert torch.equal(bf16[name], fp32[name].to(bf16[name].dtype)), name


MTP = {"qwen3_5": 15, "qwen3_5_moe": 29, "qwen3_next": 29, "deepseek_v3": 32}


@pytest.mark.parametrize("family", list(MTP), ids=list(MTP))
def test_fake_mtp_tensors_are_indexed_and_ignored_by_transformers(family, tmp_path):
    path = oracle.make_hf_checkpoint(family, tmp_path / "mtp", mtp_layers=1)
    config = json.loads((path / "config.json").read_text())
    field = "num_nextn_predict_layers" if family == "deepseek_v3" else "mtp_num_hidden_layers"
    assert config[field] == 1
    before = oracle.hf_logits(path, INPUT_IDS)
    added = oracle.add_fake_mtp_tensors(path, family)
    assert len(added) == MTP[family]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert {index[k] for k in added} == {"model-mtp.safetensors"}
    disk = oracle.on_disk_tensors(path)
    assert all(disk[k] == (v.dtype, tuple(v.shape)) for k, v in added.items())
    if family == "deepseek_v3":
        assert "model.layers.3.eh_proj.weight" in added
        assert "model.layers.3.mlp.experts.0.gate_proj.weight" in added
    else:
        assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight"} <= added.keys()
        assert disk["mtp.fc.weight"][1] == (64, 128)
    # transformers has no MTP module: the extra tensors must not change its logits.
    assert torch.equal(oracle.hf_logits(path, INPUT_IDS), before)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"], ids=["qwen3_5", "qwen3_5_moe"])
def test_vlm_layout_is_the_same_model_under_hub_names(family, checkpoints, tmp_path):
    path = oracle.make_hf_checkpoint(family, tmp_path / "vlm", max_shard_size="20KB")
    oracle.to_vlm_layout(path)
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["text_config"]["model_type"]) == (
        family,
        MODEL_TYPES[family],
    )
    disk = oracle.on_disk_tensors(path)
    text = oracle.on_disk_tensors(checkpoints[family])
    renamed = {
        "model.language_model." + k[6:] if k != "lm_head.weight" else k: v for k, v in text.items()
    }
    assert disk == renamed
    assert torch.equal(
        oracle.hf_logits(path, INPUT_IDS), oracle.hf_logits(checkpoints[family], INPUT_IDS)
    )
    with pytest.raises(ValueError, match="not a Qwen3.5 text checkpoint"):
        oracle.to_vlm_layout(path)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "nemotron_h"])
def test_mtp_needs_declared_layers(family, checkpoints):
    with pytest.raises(ValueError, match="declares no MTP layers"):
        oracle.add_fake_mtp_tensors(checkpoints[family], family)


def test_nemotron_mtp_uses_the_flattened_block_names(tmp_path):
    folder = oracle.make_hf_checkpoint("nemotron_h", tmp_path / "n", mtp_layers=2)
    names = set(oracle.add_fake_mtp_tensors(folder, "nemotron_h"))
    # mtp_layers_block_type defaults to [full_attention, moe]: two blocks per depth.
    assert {n.split(".")[2] for n in names} == {"0", "1", "2", "3"}
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.2.hnorm.weight"} <= names
    assert {"mtp.layers.1.final_layernorm.weight", "mtp.layers.3.final_layernorm.weight"} <= names
    assert "mtp.layers.1.mixer.gate.e_score_correction_bias" in names
    assert "mtp.layers.0.mixer.q_proj.weight" in names


def test_config_overrides_and_errors():
    deeper = oracle.tiny_config("qwen3_5_moe", num_hidden_layers=8)
    assert deeper.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert oracle.tiny_config("nemotron_h", hybrid_override_pattern="M*").layers_block_type == [
        "linear_attention",
        "full_attention",
    ]
    with pytest.raises(ValueError, match="unknown HF family 'llama'"):
        oracle.tiny_config("llama")


@FAMILIES
def test_modeling_code_is_bound_to_torch_kernels(family):
    module = oracle.modeling_module(family)
    bindings = oracle.kernel_bindings(module)
    # DeepSeek-V3 has no hub kernels; GDN and Mamba families bind conv, scan and delta-rule ones.
    assert bool(bindings) == (family != "deepseek_v3")
    assert set(bindings.values()) <= {module.__name__}
    assert sys.modules.get("fla", "never imported") is not None  # the hiding was undone


def test_fla_imported_first_is_rebound_to_torch(tmp_path):
    """megatron imports fla before transformers' modeling code: the oracle must still use torch."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import torch
        import fla.ops.gated_delta_rule  # what megatron-core's GatedDeltaNet does
        import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as m
        import hf_oracle as oracle  # tests/unit/hf is on sys.path (pytest's rootdir-less "prepend")

        # Negative control: imported with fla visible, transformers binds fla's Triton kernels.
        bound = oracle.kernel_bindings(m)
        assert bound["torch_chunk_gated_delta_rule"].startswith("fla."), bound
        fla_before = sys.modules["fla"]
        module = oracle.modeling_module("qwen3_5_moe")
        assert set(oracle.kernel_bindings(module).values()) == {{module.__name__}}
        assert sys.modules["fla"] is fla_before  # hidden only during the import
        path = oracle.make_hf_checkpoint("qwen3_5_moe", {str(tmp_path / "ckpt")!r})
        logits = oracle.hf_logits(path, torch.zeros(1, 8, dtype=torch.long))
        assert torch.isfinite(logits).all()
        print("OK")
        """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]

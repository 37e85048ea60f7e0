"""Block-scaled FP8 folders at TP1: logits against transformers on the dequantized weights, the
folder streamed back bitwise, the release recipe against the test's quantizer, refusals."""

from __future__ import annotations

import json
import shutil

import fp8_oracle
import hf_oracle
import pytest
import torch

from megatron_hybrid.hf import dry_run, iter_hf_weights, load_hf_model, save_hf_checkpoint
from megatron_hybrid.hf import fp8 as hf_fp8

FP8 = torch.float8_e4m3fn
FAMILIES = ("deepseek_v3", "qwen3_5_moe")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _logits(model, input_ids):
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        return model.eval()(input_ids, positions, None)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_folder_gives_transformers_logits_on_its_values(family, fp8_folders, input_ids, pg):
    folder, reference, bound = fp8_folders[family]
    model = load_hf_model(folder, params_dtype=torch.float32)
    assert (_logits(model, input_ids) - reference).abs().max().item() <= bound


def test_ignoring_the_scales_fails(fp8_folders, input_ids, pg, monkeypatch):
    """Negative control: the FP8 values without their scales are another model."""
    folder, reference, bound = fp8_folders["qwen3_5_moe"]
    monkeypatch.setattr(hf_fp8, "dequantize", lambda q, s, block, offset=(0, 0): q.float())
    model = load_hf_model(folder, params_dtype=torch.float32)
    assert (_logits(model, input_ids) - reference).abs().max().item() > 100 * bound


@pytest.mark.parametrize("family", FAMILIES)
def test_dry_run_reports_the_dequantized_tensors(family, fp8_folders):
    folder = fp8_folders[family][0]
    conversion, report = dry_run(folder)
    disk = hf_oracle.read_tensors(folder)
    count = sum(1 for name in disk if name.endswith("_scale_inv"))
    assert report.ok, report.lines()
    assert report.notes == [f"FP8 block-scaled (16 x 24): {count} tensors dequantized"]
    assert conversion.quantization.block == (16, 24)


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_is_the_fp8_folder_bitwise(family, fp8_folders, pg):
    """``quantize="source"`` (the default) gives back the FP8 bytes and scales, the modules
    ``modules_to_not_convert`` names unquantized, and nothing else."""
    folder = fp8_folders[family][0]
    disk = hf_oracle.read_tensors(folder)
    streamed = dict(iter_hf_weights(load_hf_model(folder, params_dtype=torch.float32)))
    assert set(streamed) == set(disk)
    wrong = [name for name, tensor in disk.items() if not _same(streamed[name], tensor)]
    assert wrong == []
    if family == "deepseek_v3":  # kept unquantized by the folder: stays so
        assert streamed["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float32


def test_quantize_none_writes_values_in_the_parameters_dtype(fp8_folders, pg):
    folder = fp8_folders["deepseek_v3"][0]
    disk = hf_oracle.read_tensors(folder)
    block = (16, 24)
    streamed = dict(iter_hf_weights(load_hf_model(folder), quantize="none"))
    assert set(streamed) == {n for n in disk if not n.endswith("_scale_inv")}
    for name, tensor in streamed.items():
        scale = disk.get(name + "_scale_inv")
        expected = (
            disk[name] if scale is None else fp8_oracle.dequantize_loop(disk[name], scale, block)
        )
        assert _same(tensor, expected), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_recipe_is_the_test_quantizer(family, dtype, hf_folders, pg):
    """``quantize="fp8"`` on an unquantized model: the modules the family's release quantizes
    are FP8 (128 x 128, float32 scales) with the test quantizer's bytes, the others as they
    were. Control: 64 x 128 blocks give other scales."""
    folder = hf_folders[family][0]
    model = load_hf_model(folder, params_dtype=dtype)
    plain = dict(iter_hf_weights(model, quantize="none", dtype=dtype))
    streamed = dict(iter_hf_weights(model, quantize="fp8", dtype=dtype))
    expected, control = {}, {}
    for name, tensor in plain.items():
        if fp8_oracle.release_quantizes(family, name, tensor):
            q, s = fp8_oracle.quantize_blocks_loop(tensor, (128, 128))
            expected[name], expected[name + "_scale_inv"] = q, s
            control[name + "_scale_inv"] = fp8_oracle.quantize_blocks_loop(tensor, (64, 128))[1]
        else:
            expected[name] = tensor
    assert set(streamed) == set(expected)
    assert sum(1 for n in expected if n.endswith("_scale_inv")) > 10
    assert [n for n, t in expected.items() if not _same(streamed[n], t)] == []
    assert any(not _same(streamed[n], t) for n, t in control.items())


def test_saved_recipe_folder_says_what_is_unquantized(hf_folders, tmp_path, pg):
    folder = hf_folders["qwen3_5_moe"][0]
    out = save_hf_checkpoint(load_hf_model(folder), tmp_path / "fp8", quantize="fp8")
    config = json.loads((out / "config.json").read_text())
    written = hf_oracle.read_tensors(out)
    matrices = {n for n, t in written.items() if n.endswith(".weight") and t.dim() == 2}
    kept = {n for n in matrices if written[n].dtype != FP8}
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": fp8_oracle.modules_of(kept),
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    assert "model.layers.0.mlp.gate" in config["quantization_config"]["modules_to_not_convert"]
    # The written folder reads back: its FP8 weights dequantize to the values it was made of.
    conversion, report = dry_run(out)
    assert report.ok and conversion.quantization.block == (128, 128)


def test_fp8_recipe_is_refused_for_a_family_without_release(hf_folders, pg):
    model = load_hf_model(hf_folders["nemotron_h"][0])
    with pytest.raises(ValueError, match="nemotron_h has no block-scaled FP8 release"):
        next(iter_hf_weights(model, quantize="fp8"))
    with pytest.raises(ValueError, match="quantize='fp4'"):
        next(iter_hf_weights(model, quantize="fp4"))


def _with_quantization(folder, tmp_path, quantization):
    copy = shutil.copytree(folder, tmp_path / "q")
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = quantization
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "compressed-tensors"),
        ({"quant_method": "gptq", "bits": 4}, "GPTQ"),
        ({"quant_method": "awq", "bits": 4}, "AWQ"),
        ({"quant_method": "mxfp4"}, "MXFP4"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor FP8"),
    ],
    ids=["compressed-tensors", "gptq", "awq", "mxfp4", "per-tensor-fp8"],
)
def test_cli_refuses_other_quantizations_with_one_message(
    quantization, message, hf_folders, tmp_path, capsys
):
    from megatron_hybrid.cli.main import main

    folder = _with_quantization(hf_folders["qwen3_5"][0], tmp_path, quantization)
    code = main(["convert", "--from-hf", str(folder), "--save", str(tmp_path / "ckpt"),
                 "--ignore-hf-config-field", "quantization_config"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "quantization_config" in err and "Traceback" not in err
    assert err.count("error:") == 1
    assert not (tmp_path / "ckpt").exists()


def test_cli_refuses_an_inconsistent_fp8_folder(fp8_folders, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from megatron_hybrid.cli.main import main

    folder = shutil.copytree(fp8_folders["deepseek_v3"][0], tmp_path / "broken")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"
    file = folder / index["weight_map"][name]
    tensors = load_file(file)
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, file)
    code = main(["convert", "--from-hf", str(folder), "--dry-run"])
    assert code == 2
    assert name in capsys.readouterr().err


def test_multimodal_stray_tensor_is_refused_by_name(tmp_path, capsys):
    """The vision tower is carried through; a tensor under no declared part is not."""
    from safetensors.torch import load_file, save_file

    from megatron_hybrid.cli.main import main

    folder = hf_oracle.make_vlm_checkpoint("qwen3_5_moe", tmp_path / "vlm")
    conversion, report = dry_run(folder)
    assert report.ok and len(report.carried) == 33
    assert report.notes == [
        "carried through untouched: 33 tensors under model.visual.* (vision_config; the hybrid "
        "model does not compute them)"
    ]
    tensors = load_file(folder / "model.safetensors")
    tensors["model.audio_tower.proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, folder / "model.safetensors")
    code = main(["convert", "--from-hf", str(folder), "--save", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and "model.audio_tower.proj.weight" in err
    assert "not used by the model (1)" in err


def test_stream_after_a_step_requantizes_only_what_changed(fp8_folders, pg):
    """The RL loop: after an in-place update of one block of one weight, ``quantize="source"``
    streams the new values (the stream's cached parameter slices see them), that block with the
    recipe's new scale, and every other block and weight with its source bytes."""
    folder = fp8_folders["qwen3_5_moe"][0]
    disk = hf_oracle.read_tensors(folder)
    model = load_hf_model(folder, params_dtype=torch.float32)
    assert [n for n, t in iter_hf_weights(model) if not _same(t, disk[n])] == []
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    with torch.no_grad():
        weight = dict(iter_hf_weights(model, quantize="none"))[name]  # a view of the parameter
        weight[20, 30] = 1.5 * weight[16:32, 24:48].abs().max()  # block (1, 1): a new amax
    after = dict(iter_hf_weights(model))
    changed = [n for n, t in after.items() if not _same(t, disk[n])]
    assert sorted(changed) == [name, name + "_scale_inv"]
    q, s = fp8_oracle.quantize_blocks_loop(weight, (16, 24), torch.bfloat16)
    assert _same(after[name], q) and _same(after[name + "_scale_inv"], s)
    moved = (after[name + "_scale_inv"] != disk[name + "_scale_inv"]).nonzero().tolist()
    assert moved == [[1, 1]]


def test_merged_lora_then_fp8(hf_folders, pg):
    """merge_lora and quantize compose: LoRA merged per shard, gathered, then quantized (the
    test quantizer of the merged weights, bitwise); the plain stream afterwards is the base
    again (no merged value left in the stream's caches)."""
    from megatron_hybrid.peft import LoRAConfig, apply_lora, lora_parameters

    folder = hf_folders["qwen3_5_moe"][0]
    base = hf_oracle.read_tensors(folder)
    model = load_hf_model(folder, params_dtype=torch.float32)
    assert all(_same(t, base[n]) for n, t in iter_hf_weights(model, quantize="none"))
    apply_lora(model, LoRAConfig(rank=4, alpha=8))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in lora_parameters(model):
            param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    merged = dict(iter_hf_weights(model, quantize="none", merge_lora=True))
    streamed = dict(iter_hf_weights(model, quantize="fp8", merge_lora=True))
    quantized = 0
    for name, tensor in merged.items():
        if fp8_oracle.release_quantizes("qwen3_5_moe", name, tensor):
            q, s = fp8_oracle.quantize_blocks_loop(tensor, (128, 128))
            assert _same(streamed[name], q) and _same(streamed[name + "_scale_inv"], s), name
            quantized += not torch.equal(tensor, base[name])
    assert quantized > 10  # merged weights (not the base) went through the quantizer
    stream = iter_hf_weights(model, quantize="none", merge_lora=False)
    assert all(_same(t, base[n]) for n, t in stream)


@pytest.fixture(scope="module")
def fp8_vlm_folder(vlm_folder, tmp_path_factory):
    """The multimodal folder in FP8, its vision tower's linears FP8 too (16 x 24 blocks)."""
    return fp8_oracle.make_fp8_folder(vlm_folder, tmp_path_factory.mktemp("fp8_vlm") / "vlm")


def test_carried_fp8_weights_are_dequantized_when_the_export_is_not_the_source(
    fp8_vlm_folder, tmp_path, pg
):
    """A carried FP8 weight goes back as it came with ``quantize="source"``; with ``"none"``
    and ``"fp8"`` (whose releases keep the vision tower unquantized) it is written dequantized
    and its scale dropped, so that no FP8 weight in the source's 16 x 24 blocks is left in a
    folder that declares none, or 128 x 128 ones."""
    disk = hf_oracle.read_tensors(fp8_vlm_folder)
    visual = [n for n, t in disk.items() if n.startswith("model.visual.") and t.dtype == FP8]
    assert len(visual) > 5
    model = load_hf_model(fp8_vlm_folder, params_dtype=torch.float32)
    source = hf_oracle.read_tensors(save_hf_checkpoint(model, tmp_path / "source"))
    assert [n for n in disk if not _same(source[n], disk[n])] == [] and set(source) == set(disk)
    for mode in ("none", "fp8"):
        out = save_hf_checkpoint(model, tmp_path / mode, quantize=mode)
        written = hf_oracle.read_tensors(out)
        for name in visual:
            expected = fp8_oracle.dequantize_loop(disk[name], disk[name + "_scale_inv"], (16, 24))
            assert _same(written[name], expected), (mode, name)
            assert name + "_scale_inv" not in written, (mode, name)
        config = json.loads((out / "config.json").read_text())
        if mode == "fp8":
            kept = config["quantization_config"]["modules_to_not_convert"]
            assert {n.removesuffix(".weight") for n in visual} <= set(kept)
        conversion, report = dry_run(out)
        assert report.ok, (mode, report.lines())


def test_carried_fp8_weight_without_its_scale_is_refused(fp8_vlm_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(fp8_vlm_folder, tmp_path / "broken")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.visual.blocks.0.attn.qkv.weight_scale_inv"
    file = folder / index["weight_map"].pop(name)
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.visual.blocks.0.attn.qkv.weight is FP8 but"):
        dry_run(folder)

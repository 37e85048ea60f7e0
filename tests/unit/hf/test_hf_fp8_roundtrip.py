"""Release folders through the command line and back: FP8 -> torch_dist -> FP8 bitwise (float32
and bf16 parameters), and a multimodal Qwen3.5-MoE whole, which transformers reloads as the
class it was."""

from __future__ import annotations

import json

import fp8_oracle
import hf_oracle
import pytest
import torch
from test_hf_roundtrip import _convert
from test_hf_train import SHORT, _cli_worker, train

pytestmark = pytest.mark.slow

FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _round_trip(source, tmp_path, *forward, back=()):
    run = _convert("--from-hf", str(source), "--save", str(tmp_path / "ckpt"), *forward)
    assert run.returncode == 0, run.stderr
    out = tmp_path / "out"
    run_back = _convert("--load", str(tmp_path / "ckpt"), "--to-hf", str(out), *back)
    assert run_back.returncode == 0, run_back.stderr
    return run.stdout, out


def test_fp8_cli_round_trip_is_bitwise(fp8_folders, tmp_path):
    """DeepSeek-V3, float32 parameters: the FP8 bytes, the scales, the modules kept unquantized
    and quantization_config come back; ``--quantize none`` from the same checkpoint writes the
    dequantized values."""
    source = fp8_folders["deepseek_v3"][0]
    stdout, out = _round_trip(source, tmp_path, "--dtype", "float32")
    before, after = hf_oracle.read_tensors(source), hf_oracle.read_tensors(out)
    count = sum(1 for name in before if name.endswith("_scale_inv"))
    assert f"FP8 block-scaled (16 x 24): {count} tensors dequantized" in stdout
    assert set(after) == set(before)
    assert [n for n, t in before.items() if not _same(after[n], t)] == []
    config = json.loads((out / "config.json").read_text())
    source_config = json.loads((source / "config.json").read_text())
    assert config["quantization_config"] == source_config["quantization_config"]
    plain = tmp_path / "plain"
    run = _convert("--load", str(tmp_path / "ckpt"), "--to-hf", str(plain), "--quantize", "none")
    assert run.returncode == 0, run.stderr
    values = hf_oracle.read_tensors(plain)
    assert set(values) == {n for n in before if not n.endswith("_scale_inv")}
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    expected = fp8_oracle.dequantize_loop(before[name], before[name + "_scale_inv"], (16, 24))
    assert _same(values[name], expected)
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())


def test_fp8_cli_round_trip_in_bf16_keeps_the_fp8_bytes(fp8_folders, tmp_path):
    """Qwen3.5-MoE (bfloat16 scales) held in bf16 parameters: every FP8 weight and scale comes
    back bitwise (bf16 holds q * s within 2**-9, FP8's rounding step is 2**-3)."""
    source = fp8_folders["qwen3_5_moe"][0]
    _, out = _round_trip(source, tmp_path, "--dtype", "bfloat16")
    before, after = hf_oracle.read_tensors(source), hf_oracle.read_tensors(out)
    assert set(after) == set(before)
    fp8 = [n for n in before if before[n].dtype == FP8 or n.endswith("_scale_inv")]
    assert len(fp8) > 100
    assert [n for n in fp8 if not _same(after[n], before[n])] == []


def test_multimodal_folder_round_trips_whole(tmp_path, input_ids):
    """The vision tower is carried through the checkpoint untouched; the folder written back is
    the source bitwise, config.json included, and transformers loads it as
    Qwen3_5MoeForConditionalGeneration with the source's logits."""
    source = hf_oracle.make_vlm_checkpoint("qwen3_5_moe", tmp_path / "vlm", max_shard_size="60KB")
    stdout, out = _round_trip(source, tmp_path, back=("--max-shard-size", "60KB"))
    assert "carried through untouched: 33 tensors under model.visual.*" in stdout
    before, after = hf_oracle.read_tensors(source), hf_oracle.read_tensors(out)
    assert set(after) == set(before)
    assert [n for n, t in before.items() if not _same(after[n], t)] == []
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()
    cls, logits = hf_oracle.vlm_logits(out, input_ids)
    source_cls, source_logits = hf_oracle.vlm_logits(source, input_ids)
    assert cls == source_cls == "Qwen3_5MoeForConditionalGeneration"
    assert torch.equal(logits, source_logits)


def test_trained_fp8_start_exports_fp8_again(fp8_folders, tmp_path):
    """``train --load-hf FP8 --save RUN`` records the source format, so ``convert --load RUN
    --to-hf`` writes FP8 (every weight the source had as FP8, with its scales) and the folder
    reads back."""
    from megatron_hybrid.hf import dry_run
    from megatron_hybrid.testing.spawn import run_distributed

    source = fp8_folders["qwen3_5_moe"][0]
    losses = train("--load-hf", str(source), "--train-iters", "2", *SHORT,
                   "--save", str(tmp_path / "run"))  # fmt: skip
    assert len(losses) == 2
    argv = ["--load", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")]
    assert run_distributed(_cli_worker, 1, argv)[0] == 0
    before, after = hf_oracle.read_tensors(source), hf_oracle.read_tensors(tmp_path / "out")
    assert set(after) == set(before)
    assert all(after[n].dtype == t.dtype for n, t in before.items())
    moved = [n for n, t in before.items() if t.dtype == FP8 and not _same(after[n], t)]
    assert moved  # trained: the weights changed, and were quantized again
    conversion, report = dry_run(tmp_path / "out")
    assert report.ok and conversion.quantization.block == (16, 24)

"""Block-scaled FP8 without a model: the quantizer against the test's independent one, the
fused kernel against the reference (Triton's interpreter, on the CPU), reading boxes of FP8
weights, the bucketed stream, and quantization configs read or refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fp8_oracle
import pytest
import torch

from megatron_hybrid.hf.fp8 import (
    BlockFP8,
    DequantizingReader,
    UnsupportedQuantizationError,
    block_fp8_format,
    dequantize,
    module_matches,
    quantize_reference,
)
from megatron_hybrid.hf.fp8_stream import BucketQuantizer, FP8Spec
from megatron_hybrid.hf.io import HFCheckpoint, HFCheckpointError

FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _weights(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Magnitudes from 2**-24 to 2**5 (FP8 subnormals inside a block), one all-zero block."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.randint(-24, 6, shape, generator=g).float().exp2()
    w = (torch.randn(shape, generator=g) * spread).to(dtype)
    w[:8, :8] = 0
    return w


CASES = [((40, 50), (16, 24)), ((24, 64), (16, 16)), ((130, 129), (128, 128)), ((7, 3), (16, 24))]
CASE_IDS = ["partial-edges", "aligned", "recipe-block-partial", "one-partial-block"]


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["s-fp32", "s-bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["w-fp32", "w-bf16"])
@pytest.mark.parametrize(("shape", "block"), CASES, ids=CASE_IDS)
def test_reference_quantizer_is_the_recipe(shape, block, dtype, scale_dtype):
    w = _weights(shape, dtype)
    q, s = quantize_reference(w, block, scale_dtype=scale_dtype)
    q_loop, s_loop = fp8_oracle.quantize_blocks_loop(w, block, scale_dtype)
    assert _same(q, q_loop)
    assert _same(s.to(scale_dtype), s_loop)
    # Controls: the other block orientation, or a scale not rounded to its stored dtype before
    # q is computed (bf16 scales), give other bytes.
    if block[0] != block[1] and shape[0] > block[0]:
        assert not _same(quantize_reference(w, block[::-1])[0], q)
    if scale_dtype == torch.bfloat16 and shape[0] > 8:
        assert not _same(quantize_reference(w, block)[0], q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["w-fp32", "w-bf16"])
def test_source_scales_give_the_source_bytes_back(dtype):
    """A dequantized weight (held in float32 or bf16) quantized with its source scales is its
    source bytes; a changed block takes the recipe's scale."""
    block = (16, 24)
    q, s = fp8_oracle.quantize_blocks_loop(_weights((40, 50)), block, torch.bfloat16)
    values = fp8_oracle.dequantize_loop(q, s, block).to(dtype)
    q2, s2 = quantize_reference(values, block, s, torch.bfloat16)
    assert _same(q2, q) and _same(s2.to(torch.bfloat16), s)
    changed = values.clone()
    changed[20, 30] = changed[16:32, 24:48].abs().max() * 1.3  # block (1, 1) leaves its grid
    q3, s3 = quantize_reference(changed, block, s, torch.bfloat16)
    fresh_q, fresh_s = fp8_oracle.quantize_blocks_loop(changed, block, torch.bfloat16)
    assert s3[1, 1] != s[1, 1] and s3[1, 1] == fresh_s[1, 1].float()
    assert _same(q3[16:32, 24:48], fresh_q[16:32, 24:48])
    assert _same(q3[:16], q[:16])  # other blocks keep theirs


def _faulty(dtype=torch.float32) -> torch.Tensor:
    """32 x 48 in 16 x 24 blocks: a NaN in block (0, 0), an infinity in (1, 1), block (0, 1)
    zeros and one value so small that ``amax / 448`` is 0 in float32 (and in bfloat16), block
    (1, 0) ordinary."""
    w = _weights((32, 48), seed=5)
    w[3, 4] = float("nan")
    w[20, 30] = float("inf")
    w[:16, 24:] = 0
    w[5, 30] = 1e-44
    return w.to(dtype)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["s-fp32", "s-bf16"])
def test_non_finite_weights_give_non_finite_scales(scale_dtype):
    """A block holding a NaN gets a NaN scale, one holding an infinity an infinite one (the
    fault shows, not finite garbage: before, a NaN block got the scale 1); a block whose scale
    underflows gets 1 (before: 0, and its zeros became 0 / 0 = NaN)."""
    w = _faulty()
    q, s = quantize_reference(w, (16, 24), scale_dtype=scale_dtype)
    assert s[0, 0].isnan() and s[1, 1].isinf() and s[0, 1] == 1
    for block in (q[:16, :24], q[16:, 24:], q[:16, 24:]):  # the faulty blocks' values are 0
        assert block.float().eq(0).all()
    back = fp8_oracle.dequantize_loop(q, s, (16, 24))
    assert back[:16, :24].isnan().all() and back[16:, 24:].isnan().all()
    assert back[:16, 24:].eq(0).all()
    q_loop, s_loop = fp8_oracle.quantize_blocks_loop(w[16:, :24], (16, 24), scale_dtype)
    assert _same(q[16:, :24], q_loop) and _same(s[1:, :1].to(scale_dtype), s_loop)


KERNEL_CHECK = """
import torch
from megatron_hybrid.hf.fp8 import quantize_reference
from megatron_hybrid.hf.fp8_kernel import quantize_blocks
cases = {cases!r}
bad = []
for shape, block in cases:
    g = torch.Generator().manual_seed(0)
    spread = torch.randint(-24, 6, shape, generator=g).float().exp2()
    base = torch.randn(shape, generator=g) * spread
    base[:8, :8] = 0
    for dtype in (torch.float32, torch.bfloat16):
        w = base.to(dtype)
        for sd in (torch.float32, torch.bfloat16):
            q, s = quantize_blocks(w, block, scale_dtype=sd)
            qr, sr = quantize_reference(w, block, scale_dtype=sd)
            values = (qr.float() * sr.repeat_interleave(block[0], 0)[: shape[0]]
                      .repeat_interleave(block[1], 1)[:, : shape[1]]).to(dtype)
            values[-1, -1] += 1.0  # the last block leaves its source scale's grid
            qc, sc = quantize_blocks(values, block, sr.to(sd), sd)
            qcr, scr = quantize_reference(values, block, sr.to(sd), sd)
            same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            if not (same(q, qr) and torch.equal(s, sr) and same(qc, qcr) and torch.equal(sc, scr)):
                bad.append((shape, block, str(dtype), str(sd)))
    plain = torch.randn(shape, generator=g)
    wrong, _ = quantize_blocks(plain, block[::-1])
    right = quantize_reference(plain, block)[0]
    control = torch.equal(wrong.view(torch.uint8), right.view(torch.uint8))
    if control and block[0] != block[1] and min(shape) > min(block):
        bad.append(("control did not differ", block))
for sd in (torch.float32, torch.bfloat16):  # non-finite values: the same NaN / inf places
    w = torch.randn(32, 48, generator=g)
    w[3, 4], w[20, 30], w[:16, 24:] = float("nan"), float("inf"), 0
    w[5, 30] = 1e-44
    q, s = quantize_blocks(w, (16, 24), scale_dtype=sd)
    qr, sr = quantize_reference(w, (16, 24), scale_dtype=sd)
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    same_s = torch.equal(s.isnan(), sr.isnan()) and torch.equal(s.nan_to_num(), sr.nan_to_num())
    if not (same(q, qr) and same_s and s[0, 0].isnan() and s[1, 1].isinf()):
        bad.append(("non-finite", str(sd)))
print("BAD", bad)
"""


@pytest.mark.slow
def test_triton_kernel_matches_reference_in_the_interpreter():
    """The fused kernel run by Triton's interpreter (TRITON_INTERPRET=1, a fresh process: the
    variable must be set before Triton is imported) gives the reference's bytes and scales, with
    and without source scales, for partial and non-power-of-two blocks and FP8 subnormals."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK.format(cases=CASES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "BAD []" in run.stdout, run.stdout


def test_kernel_times_only_warp_counts_that_keep_a_block_in_registers():
    """The autotuner times (and an autotuner told to take its first config compiles) only warp
    counts that give a thread at most 64 of the block's values, most warps first: a 128 x 128
    block with 2 warps spills and compiles 10 to 30 times slower. Every count is kept for small
    blocks, and the most warps where none fits."""
    import triton

    from megatron_hybrid.hf import fp8_kernel

    assert fp8_kernel._warps_for(128 * 128) == (16, 8)
    assert fp8_kernel._warps_for(16 * 32) == (16, 8, 4, 2)
    assert fp8_kernel._warps_for(1024 * 1024) == (16,)
    configs = [triton.Config({}, num_warps=w) for w in (2, 4, 8, 16)]
    pruned = fp8_kernel._prune(configs, {"w_ptr": None}, BO_P=128, BI_P=64)
    assert [c.num_warps for c in pruned] == [16, 8, 4]


def _fp8_folder(tmp_path: Path, tensors: dict, quantization: dict | None) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, tmp_path / "model.safetensors")
    config = {"model_type": "deepseek_v3"}
    if quantization is not None:
        config["quantization_config"] = quantization
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


FORMAT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 24]}


def test_reader_reads_only_the_blocks_of_a_box(tmp_path, monkeypatch):
    """A box cut inside blocks reads as the dequantized weight's box; only its blocks' scales
    are read."""
    block = (16, 24)
    q, s = fp8_oracle.quantize_blocks_loop(_weights((40, 50)), block)
    folder = _fp8_folder(tmp_path, {"a.weight": q, "a.weight_scale_inv": s}, FORMAT)
    source = HFCheckpoint(folder)
    reader = DequantizingReader(source, block_fp8_format(source.config))
    full = fp8_oracle.dequantize_loop(q, s, block)
    assert reader.names() == ["a.weight"] and reader.info("a.weight")[0] == FP8
    assert torch.equal(reader.get("a.weight"), full)
    asked = []
    read = source.read
    monkeypatch.setattr(source, "read", lambda n, i: asked.append((n, i)) or read(n, i))
    box = reader.read("a.weight", (slice(20, 37), slice(30, 50)))
    assert torch.equal(box, full[20:37, 30:50])
    assert asked[-1] == ("a.weight_scale_inv", (slice(1, 3), slice(1, 3)))
    # Control: the box's scales taken from the top-left blocks give other values.
    assert not torch.equal(dequantize(q[20:37, 30:50], s[:2, :2], block, (20, 30)), box)


@pytest.mark.parametrize(
    ("tensors", "quantization", "match"),
    [
        ({"a.weight": "q"}, FORMAT, "has no a.weight_scale_inv"),
        ({"a.weight": "q", "a.weight_scale_inv": torch.ones(2, 2)}, FORMAT, r"shape \(2, 2\)"),
        ({"b.weight_scale_inv": torch.ones(1, 1)}, FORMAT, "b.weight, which the folder"),
        ({"a.weight": "q", "a.weight_scale_inv": "s"}, None, "no quantization_config"),
        (
            {"a.weight": "q", "a.weight_scale_inv": "s"},
            {**FORMAT, "modules_to_not_convert": ["a"]},
            "modules_to_not_convert names its module",
        ),
        ({"a.weight": torch.ones(3, 3), "a.weight_scale_inv": "s"}, FORMAT, "torch.float32"),
    ],
    ids=["no-scale", "scale-shape", "scale-alone", "no-config", "not-to-convert", "not-fp8"],
)
def test_inconsistent_fp8_folders_are_refused_by_name(tensors, quantization, match, tmp_path):
    q, s = fp8_oracle.quantize_blocks_loop(_weights((40, 50)), (16, 24))
    values = {n: (q if t == "q" else s if t == "s" else t) for n, t in tensors.items()}
    source = HFCheckpoint(_fp8_folder(tmp_path, values, quantization))
    fmt = block_fp8_format(source.config)
    with pytest.raises(HFCheckpointError, match=match):
        DequantizingReader(source, fmt)


@pytest.mark.parametrize("value", [-0.5, 0.0, -0.0], ids=["negative", "zero", "minus-zero"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["s-fp32", "s-bf16"])
def test_a_scale_that_is_not_positive_is_refused_by_name(value, scale_dtype, tmp_path):
    """A negative scale flips a block's signs, a zero one erases it, with finite values either
    way (no NaN for the later checks to find): both reading paths refuse it by name and file."""
    q, s = fp8_oracle.quantize_blocks_loop(_weights((40, 50)), (16, 24), scale_dtype)
    s[2, 1] = value
    folder = _fp8_folder(tmp_path, {"a.weight": q, "a.weight_scale_inv": s}, FORMAT)
    source = HFCheckpoint(folder)
    reader = DequantizingReader(source, block_fp8_format(source.config))
    match = (
        rf"{folder / 'model.safetensors'}: a\.weight_scale_inv holds the scale -?0?\.?[0-9]* at "
        r"block \[2, 1\]; block scales must be positive"
    )
    with pytest.raises(HFCheckpointError, match=match):
        reader.get("a.weight")
    with pytest.raises(HFCheckpointError, match=match):
        reader.scale_tensors()
    assert reader.read("a.weight", (slice(0, 16), slice(0, 24))).abs().sum() > 0  # other blocks


def test_negative_control_without_the_check_a_negative_scale_reads_as_values(tmp_path, monkeypatch):
    q, s = fp8_oracle.quantize_blocks_loop(_weights((40, 50)), (16, 24))
    s[2, 1] = -s[2, 1]
    source = HFCheckpoint(_fp8_folder(tmp_path, {"a.weight": q, "a.weight_scale_inv": s}, FORMAT))
    monkeypatch.setattr(DequantizingReader, "_check_positive", lambda *args: None)
    values = DequantizingReader(source, block_fp8_format(source.config)).get("a.weight")
    assert torch.isfinite(values).all()  # silently wrong: the refusal above is the only guard


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"quant_method": "compressed-tensors"}, "compressed-tensors checkpoints are not read"),
        ({"quant_method": "gptq"}, "GPTQ checkpoints are not read"),
        ({"quant_method": "awq"}, "AWQ checkpoints are not read"),
        ({"quant_method": "mxfp4"}, "MXFP4 checkpoints are not read"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes checkpoints are not read"),
        ({"weight_block_size": None}, "per-tensor FP8"),
        ({"fmt": "e5m2"}, "fmt 'e5m2' is not read"),
        ({"activation_scheme": "static"}, "activation_scheme 'static' is not read"),
        ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0' is not read"),
        ({"expert_dtype": "fp4"}, "expert_dtype 'fp4' is not read"),
        ({"weight_block_size": [128]}, "not two positive integers"),
        ({"group_size": 128}, "fields this package does not know: group_size"),
    ],
    ids=[
        "compressed-tensors",
        "gptq",
        "awq",
        "mxfp4",
        "bitsandbytes",
        "per-tensor",
        "e5m2",
        "static",
        "ue8m0",
        "fp4-experts",
        "bad-block",
        "unknown-field",
    ],
)
def test_other_quantizations_are_refused_by_name(changes, match):
    config = {k: v for k, v in {**FORMAT, **changes}.items() if v is not None}
    with pytest.raises(UnsupportedQuantizationError, match=match):
        block_fp8_format({"quantization_config": config})


def test_block_fp8_format_reads_the_release_config():
    release = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"],
    }
    fmt = block_fp8_format({"text_config": {}, "quantization_config": release})
    assert fmt == BlockFP8((128, 128), ("lm_head", "model.layers.0.mlp.gate"))
    assert fmt.describe() == "FP8 block-scaled (128 x 128)"
    assert block_fp8_format({"model_type": "qwen3_5_moe"}) is None


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("model.layers.0.mlp.gate", "mlp.gate"),
        ("model.layers.0.mlp.gate_proj", None),
        ("model.layers.0.mlp.shared_expert_gate", "mlp.shared_expert_gate"),
        ("model.layers.0.linear_attn.in_proj_ba", None),
        ("lm_head", "lm_head"),
    ],
    ids=["router", "gate-proj", "shared-gate", "ba-vs-b", "head"],
)
def test_module_matching_is_transformers_rule(module, expected):
    patterns = ("mlp.shared_expert_gate", "mlp.gate", "linear_attn.in_proj_b", "lm_head")
    assert module_matches(module, patterns) == expected


def test_bucketed_stream_equals_per_tensor_quantization():
    """Weights stacked by column count, rows not a whole number of blocks ending a stack, come
    out as each one quantized alone, in the order they went in, across several buckets."""
    block = (16, 24)
    shapes = [(32, 50), (40, 30), (16, 50), (24, 50), (48, 30), (32, 50), (7, 5)]
    weights = [_weights(shape, torch.bfloat16, seed=i) for i, shape in enumerate(shapes)]
    quantizer = BucketQuantizer(bucket_bytes=8000)
    spec = FP8Spec(block, torch.bfloat16)
    out = []
    for i, w in enumerate(weights):
        out += quantizer.add(f"w{i}.weight", w, spec)
    out += quantizer.flush()
    names = [n for i in range(len(weights)) for n in (f"w{i}.weight", f"w{i}.weight_scale_inv")]
    assert [n for n, _ in out] == names
    got = dict(out)
    for i, w in enumerate(weights):
        q, s = fp8_oracle.quantize_blocks_loop(w, block, torch.bfloat16)
        assert _same(got[f"w{i}.weight"], q) and _same(got[f"w{i}.weight_scale_inv"], s), i

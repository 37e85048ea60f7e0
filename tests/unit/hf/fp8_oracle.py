"""FP8 oracle for the converter tests: an independent block-scaled FP8 quantizer and the folders
it makes from the tiny transformers checkpoints of ``hf_oracle``.

:func:`quantize_blocks_loop` is the recipe of the FP8 releases written the plainest way (one
block at a time, no padding, no vectorised reshapes), independently of the package's
``quantize_reference`` and Triton kernel: ``s = amax(block) / 448`` in float32 (1 for an all-zero
block, whose values are 0 whatever the scale), rounded to the scale dtype, and
``q = clamp(w / s, -448, 448)`` cast to ``float8_e4m3fn``.

:func:`make_fp8_folder` turns a float32 folder into an FP8 release-like one (the FP8 weights and
their ``weight_scale_inv``, two shards and an index, a ``quantization_config`` with a non-empty
``modules_to_not_convert``); :func:`make_dequantized_folder` writes the float32 values an FP8
folder stands for (``q * s``), the folder transformers is run on for reference logits.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import hf_oracle
import torch

FP8 = torch.float8_e4m3fn

#: Modules each family's official FP8 release keeps unquantized (test-side copy of the lists
#: the package cites, as module-name suffixes): embedding, head, routers, ...
RELEASE_UNQUANTIZED = {
    "deepseek_v3": ("embed_tokens", "lm_head", "mlp.gate", "eh_proj", "shared_head.head"),
    "qwen3_5_moe": (
        "embed_tokens",
        "lm_head",
        "linear_attn.in_proj_a",
        "linear_attn.in_proj_b",
        "mlp.gate",
        "mlp.shared_expert_gate",
        "mtp.fc",
    ),
    "qwen3_5": (
        "embed_tokens",
        "lm_head",
        "linear_attn.in_proj_a",
        "linear_attn.in_proj_b",
        "mtp.fc",
    ),
    "qwen3_next": (
        "embed_tokens",
        "lm_head",
        "linear_attn.in_proj_ba",
        "mlp.gate",
        "mlp.shared_expert_gate",
        "mtp.fc",
    ),
}


def quantize_blocks_loop(
    w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn, s scale_dtype)`` of a 2-D weight, one block at a time."""
    rows, cols = w.shape
    bo, bi = block
    q = torch.empty(rows, cols, dtype=FP8)
    s = torch.empty(math.ceil(rows / bo), math.ceil(cols / bi), dtype=torch.float32)
    for i in range(0, rows, bo):
        for j in range(0, cols, bi):
            tile = w[i : i + bo, j : j + bi].float()
            amax = tile.abs().max()
            scale = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scale = scale.to(scale_dtype).float()
            q[i : i + bo, j : j + bi] = torch.clamp(tile / scale, -448.0, 448.0).to(FP8)
            s[i // bo, j // bi] = scale
    return q, s.to(scale_dtype)


def dequantize_loop(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q.float() * s`` block by block (float32)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    bo, bi = block
    for i in range(0, q.shape[0], bo):
        for j in range(0, q.shape[1], bi):
            out[i : i + bo, j : j + bi] = (
                q[i : i + bo, j : j + bi].float() * s[i // bo, j // bi].float()
            )
    return out


def release_quantizes(family: str, name: str, tensor: torch.Tensor) -> bool:
    """Whether the family's release stores ``name`` as FP8: a 2-D weight of a module the
    release does not keep unquantized."""
    if not name.endswith(".weight") or tensor.dim() != 2:
        return False
    module = name.removesuffix(".weight")
    return not any(module == m or module.endswith("." + m) for m in RELEASE_UNQUANTIZED[family])


def _family(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    return hf_oracle._MODEL_TYPES[config["model_type"]]


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    from safetensors.torch import save_file

    names = sorted(tensors)
    weight_map, total = {}, 0
    per_shard = math.ceil(len(names) / shards)
    for i in range(shards):
        part = names[i * per_shard : (i + 1) * per_shard]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, out / file, metadata={"format": "pt"})
        for n in part:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_fp8_folder(
    source: str | Path,
    out: str | Path,
    *,
    block: tuple[int, int] = (16, 24),
    scale_dtype: torch.dtype = torch.float32,
    also_unquantized: tuple[str, ...] = (),
    shards: int = 2,
) -> Path:
    """Write ``source`` (a float32 or bf16 folder) as a block-scaled FP8 one.

    Args:
        source: the folder.
        out: the FP8 folder (created).
        block: ``weight_block_size`` (the default is small and not a power of two, so that
            edge blocks are partial and TP cuts fall inside blocks).
        scale_dtype: storage dtype of ``weight_scale_inv``.
        also_unquantized: modules the release would quantize that this folder keeps as they
            are, listed in ``modules_to_not_convert`` with the release's own.
        shards: safetensors files (with an index).
    """
    source, out = Path(source), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    family = _family(source)
    tensors = hf_oracle.read_tensors(source)
    written, kept = {}, set()
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if release_quantizes(family, name, tensor) and module not in also_unquantized:
            q, s = quantize_blocks_loop(tensor, block, scale_dtype)
            written[name], written[name + "_scale_inv"] = q, s
        else:
            written[name] = tensor
            if name.endswith(".weight") and tensor.dim() == 2:
                kept.add(module)
    _save_sharded(written, out, shards)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": sorted(kept),
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def make_dequantized_folder(fp8_folder: str | Path, out: str | Path) -> Path:
    """The float32 values of an FP8 folder (``q * s``; other tensors as stored), no
    ``quantization_config``: what transformers runs for reference logits."""
    from safetensors.torch import save_file

    fp8_folder, out = Path(fp8_folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((fp8_folder / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    tensors = hf_oracle.read_tensors(fp8_folder)
    values = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        values[name] = tensor if scale is None else dequantize_loop(tensor, scale, block)
    save_file(values, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def modules_of(names) -> list[str]:
    """Module names of ``.weight`` tensor names (for modules_to_not_convert checks)."""
    return sorted({re.sub(r"\.weight$", "", n) for n in names if n.endswith(".weight")})

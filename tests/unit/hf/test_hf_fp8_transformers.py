"""Our FP8 folders read by transformers itself (its fine-grained FP8 loader, which on a machine
without a GPU dequantizes with its own code), not by our reader.

transformers 5.23's CPU dequantizer takes only weights whose shape the scale grid divides, so
these folders use 8 x 8 blocks (the other FP8 tests use partial 16 x 24 blocks on purpose).
"""

from __future__ import annotations

import fp8_oracle
import hf_oracle
import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_hybrid.hf import load_hf_model, save_hf_checkpoint

CASES = [("deepseek_v3", torch.float32), ("qwen3_5_moe", torch.bfloat16)]


def _export(family, scale_dtype, hf_folders, tmp_path, step: bool):
    """An FP8 source folder loaded in float32, optionally every weight moved (so each block is
    quantized again by our kernel's reference), saved back with ``quantize="source"``."""
    src = fp8_oracle.make_fp8_folder(
        hf_folders[family][0], tmp_path / "src", block=(8, 8), scale_dtype=scale_dtype
    )
    model = load_hf_model(src, params_dtype=torch.float32)
    if step:
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1 + 0.05 * torch.randn(param.shape, generator=generator))
    return save_hf_checkpoint(model, tmp_path / "ours")


def _unit_scales(folder) -> None:
    """The deliberate bug: every ``weight_scale_inv`` written as ones."""
    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if name.endswith("_scale_inv"):
                tensors[name] = torch.ones_like(tensor)
        save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("step", [False, True], ids=["as-loaded", "after-a-step"])
@pytest.mark.parametrize(("family", "scale_dtype"), CASES, ids=[f for f, _ in CASES])
def test_transformers_reads_our_fp8_folder(family, scale_dtype, step, hf_folders, input_ids,
                                           tmp_path, pg):  # fmt: skip
    """transformers on our folder equals transformers on its values dequantized by the test's
    own loop (``fp8_oracle``): the scales sit where transformers looks for them."""
    ours = _export(family, scale_dtype, hf_folders, tmp_path, step)
    values = fp8_oracle.make_dequantized_folder(ours, tmp_path / "values")
    got = hf_oracle.hf_logits(ours, input_ids)
    reference = hf_oracle.hf_logits(values, input_ids)
    assert (got - reference).abs().max().item() <= hf_oracle.logits_bound(values, input_ids)


def test_transformers_sees_skipped_scales(hf_folders, input_ids, tmp_path, pg):
    """Negative control: the same folder with its scales replaced by ones is another model."""
    ours = _export("qwen3_5_moe", torch.bfloat16, hf_folders, tmp_path, step=True)
    reference = hf_oracle.hf_logits(fp8_oracle.make_dequantized_folder(ours, tmp_path / "v"),
                                    input_ids)  # fmt: skip
    _unit_scales(ours)
    assert (hf_oracle.hf_logits(ours, input_ids) - reference).abs().max().item() > 1e-2

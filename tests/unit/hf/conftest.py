"""Tiny random Hugging Face checkpoints of every converter family, made once per session."""

from __future__ import annotations

import hf_oracle
import pytest
import torch
from hf_oracle import CONVERTED, SEQ, logits_bound


@pytest.fixture(scope="session")
def input_ids() -> torch.Tensor:
    """Token ids ``[2, SEQ]`` shared by every logits comparison."""
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory, input_ids) -> dict[str, tuple]:
    """``family -> (folder, transformers' float32 logits, logits bound)``; qwen3_5_moe is saved
    sharded (with an index)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in CONVERTED:
        shard = "40KB" if family == "qwen3_5_moe" else None
        folder = hf_oracle.make_hf_checkpoint(family, root / family, max_shard_size=shard)
        reference = hf_oracle.hf_logits(folder, input_ids)
        out[family] = (folder, reference, logits_bound(folder, input_ids, reference))
    return out


@pytest.fixture(scope="session")
def pp_folders(tmp_path_factory, hf_folders, input_ids) -> dict[str, tuple]:
    """Folders whose pattern splits into two pipeline stages without cutting a group."""
    out = dict(hf_folders)
    folder = hf_oracle.make_hf_checkpoint(
        "deepseek_v3", tmp_path_factory.mktemp("hf_pp") / "deepseek_v3", num_hidden_layers=4
    )
    reference = hf_oracle.hf_logits(folder, input_ids)
    out["deepseek_v3"] = (folder, reference, logits_bound(folder, input_ids, reference))
    return out


@pytest.fixture(scope="session")
def fp8_folders(tmp_path_factory, hf_folders, input_ids) -> dict[str, tuple]:
    """``family -> (FP8 folder, transformers' float32 logits on its dequantized weights, logits
    bound: 1e-3, or that of the dequantized folder where larger)``: DeepSeek-V3 with float32
    scales and one linear the release quantizes kept unquantized (listed in
    modules_to_not_convert), Qwen3.5-MoE with bfloat16 scales; blocks of 16 x 24, two shards and
    an index (``fp8_oracle``)."""
    import fp8_oracle

    root = tmp_path_factory.mktemp("hf_fp8")
    out = {}
    for family, scale_dtype, extra in (
        ("deepseek_v3", torch.float32, ("model.layers.0.self_attn.o_proj",)),
        ("qwen3_5_moe", torch.bfloat16, ()),
    ):
        folder = fp8_oracle.make_fp8_folder(
            hf_folders[family][0], root / family, scale_dtype=scale_dtype, also_unquantized=extra
        )
        values = fp8_oracle.make_dequantized_folder(folder, root / f"{family}_values")
        reference = hf_oracle.hf_logits(values, input_ids)
        out[family] = (folder, reference, max(1e-3, logits_bound(values, input_ids)))
    return out


@pytest.fixture(scope="session")
def fp8_pp_folders(tmp_path_factory, pp_folders) -> dict[str, tuple]:
    """An FP8 folder whose pattern splits into two pipeline stages (DeepSeek-V3, 4 layers):
    ``{"deepseek_v3": (folder, None, None)}`` (no logits: PP2 is about the split)."""
    import fp8_oracle

    folder = fp8_oracle.make_fp8_folder(
        pp_folders["deepseek_v3"][0],
        tmp_path_factory.mktemp("hf_fp8_pp") / "deepseek_v3",
        also_unquantized=("model.layers.0.self_attn.o_proj",),
    )
    return {"deepseek_v3": (folder, None, None)}


@pytest.fixture(scope="session")
def vlm_folder(tmp_path_factory):
    """A tiny multimodal Qwen3.5-MoE folder (vision tower under ``model.visual.``)."""
    return hf_oracle.make_vlm_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("vlm") / "vlm")

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

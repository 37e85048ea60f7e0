"""Tiny random Hugging Face checkpoints of every converter family, made once per session."""

from __future__ import annotations

import hf_oracle
import pytest
import torch

#: The families megatron_hybrid.hf converts (Nemotron-H is added with the Mamba torch path).
CONVERTED = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3")
SEQ = 24


@pytest.fixture(scope="session")
def input_ids() -> torch.Tensor:
    """Token ids ``[2, SEQ]`` shared by every logits comparison."""
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(7))


#: Max abs logit difference allowed against transformers (float32, sequence 24) ...
TOLERANCE = 1e-4


def logits_bound(folder, input_ids, reference) -> float:
    """:data:`TOLERANCE`, or 4x transformers' own float32 noise floor where that is larger.

    The noise floor is how far transformers' logits move when GatedDeltaNet's input
    projections run as one GEMM (megatron-core's fused ``in_proj``) instead of four: the same
    function with other float32 rounding. ``exp(A_log)`` amplifies such rounding through the
    recurrence: with the oracle's seed-0 weights the floor is 2.1e-4 for Qwen3.5-MoE and 5.4e-5
    for Qwen3-Next. The factor 4 leaves room for the other legitimate reorderings megatron makes
    (fused gate/up GEMMs, and under TP the split reductions of row-parallel layers). A single
    mapping bug moves the logits by O(1) (the negative controls in test_hf_convert.py).
    """
    fused = hf_oracle.hf_logits(folder, input_ids, fuse_projections=True)
    return max(TOLERANCE, 4 * (fused - reference).abs().max().item())


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

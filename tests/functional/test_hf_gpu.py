"""Hugging Face folders on a GPU: the ``local`` and ``transformer_engine`` backends give
transformers' float32 logits (TF32 off) and stream back the checkpoint bitwise.

The folders and transformers' logits are made on a CPU (``hf_fixtures.py``; the GPU machines
have no transformers) and found through ``MH_HF_FIXTURES``; where transformers is importable
they are made here. GatedDeltaNet runs megatron's torch path (``deterministic_mode``): fla's
Triton kernels compute in TF32-like precision and are checked separately
(test_gdn_kernels_gpu.py). Under TE the norms are fused into the linears, so the checkpoint keys
differ (``...linear_qkv.layer_norm_weight``, ``...in_proj.layer_norm_weight``); the export must
still be the on-disk Hugging Face tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import exact_float32, report

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3")

# TransformerEngine's GEMMs run float32 in TF32 whatever torch's switches say, and once TE is
# loaded so do later plain-torch models in the process (seen on one H100: logits off by 1e-2 to
# 1). cuBLAS reads this when it creates its handle, which happens after collection.
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")


def _fixtures(shared: str) -> Path:
    root = os.environ.get("MH_HF_FIXTURES")
    if root and Path(root).is_dir():
        return Path(root)
    try:
        import transformers
    except ImportError:
        pytest.skip("no MH_HF_FIXTURES folder and no transformers to make one (hf_fixtures.py)")
    if transformers.__version__ != "5.23.0":  # the oracle the families are written against
        pytest.skip(
            f"transformers {transformers.__version__} here; the oracle is 5.23.0: carry the "
            "folders hf_fixtures.py makes and point MH_HF_FIXTURES at them"
        )
    import torch.distributed as dist
    from hf_fixtures import main

    if dist.get_rank() == 0:
        main(shared)
    dist.barrier()
    return Path(shared)


def _backends():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    yield pytest.param("local", id="local")
    yield pytest.param(
        "transformer_engine",
        id="te",
        marks=pytest.mark.skipif(not HAVE_TE, reason="TransformerEngine is not installed"),
    )


@pytest.mark.parametrize("backend", list(_backends()))
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_on_gpu(family, backend, world, shared_dir):
    from safetensors.torch import load_file

    from megatron_hybrid.hf import iter_hf_weights, load_hf_model

    rank, world_size, device = world
    # deterministic_mode (GatedDeltaNet's torch path) asks TE's attention for deterministic
    # algorithms, which TE only grants with this set.
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    folder = _fixtures(shared_dir) / family
    reference = torch.load(folder / "reference.pt")
    # TP2 wherever two ranks are there (the tiny models have 2 query groups), else TP1.
    tp = 2 if world_size >= 2 and world_size % 2 == 0 else 1
    model = load_hf_model(
        folder,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=1,
        transformer_impl=backend,
        config_overrides={"deterministic_mode": True},
    ).eval()
    ids = reference["input_ids"].to(device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    # After the build: importing TransformerEngine turns TF32 back on.
    with exact_float32(), torch.no_grad():
        logits = model(ids, positions, None).float().cpu()
    diff = (logits - reference["logits"]).abs().max().item()
    disk = {}
    for file in folder.glob("*.safetensors"):
        disk.update(load_file(file))
    wrong = [
        name
        for name, tensor in iter_hf_weights(model)
        if tensor.dtype != disk[name].dtype or not torch.equal(tensor.cpu(), disk[name])
    ]
    report(
        f"hf {family} {backend} TP{tp}",
        [
            ("max abs logits diff", f"{diff:.2e}"),
            ("bound", f"{reference['bound']:.2e}"),
            ("tensors not bitwise", len(wrong)),
        ],
    )
    assert diff <= reference["bound"], diff
    assert wrong == []

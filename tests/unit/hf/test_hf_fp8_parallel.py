"""Block-scaled FP8 folders on two gloo ranks (TP2, EP2, PP2): transformers' logits on the
dequantized weights (each rank dequantizing only its own blocks, TP cuts inside 16 x 24
blocks), the folder streamed back bitwise, and FP8 -> torch_dist -> FP8 bitwise (DeepSeek-V3,
whose folder also keeps a linear the release quantizes unquantized; Qwen3.5-MoE's round trip
runs through the command line in test_hf_fp8_roundtrip). At EP2 a multimodal folder goes
through torch_dist too: its vision tower, held by rank 0 only, comes back bitwise."""

from __future__ import annotations

import hf_oracle
import pytest
import torch

from megatron_hybrid.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:
        return False
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _round_trip(folder, root, layout):
    """FP8 (or multimodal) -> torch_dist -> HF on this layout: the folder written on rank 0."""
    from pathlib import Path

    from megatron_hybrid.hf import load_hf_model, save_hf_checkpoint
    from megatron_hybrid.hf.api import build_model
    from megatron_hybrid.hf.dist import (
        conversion_of_checkpoint,
        load_model_state,
        restore_hf_source,
        save_model_state,
    )
    from megatron_hybrid.process_groups import initialize_model_parallel, reset_megatron_state

    reset_megatron_state()
    model = load_hf_model(folder, params_dtype=torch.float32, **LAYOUTS[layout])
    ckpt = Path(root) / f"{layout}_{Path(folder).name}"
    save_model_state(model, ckpt, model.hf_conversion)
    reset_megatron_state()
    conversion = conversion_of_checkpoint(ckpt)
    sizes = LAYOUTS[layout]
    pg = initialize_model_parallel(
        tp=sizes.get("tensor_model_parallel_size", 1),
        pp=sizes.get("pipeline_model_parallel_size", 1),
        ep=sizes.get("expert_model_parallel_size", 1),
    )
    fresh = build_model(conversion, pg, params_dtype=torch.float32)
    load_model_state(fresh, ckpt)
    restore_hf_source(fresh, ckpt)
    out = save_hf_checkpoint(fresh, Path(root) / f"{ckpt.name}_out", conversion=conversion)
    if out is None:
        return None
    disk, written = hf_oracle.read_tensors(folder), hf_oracle.read_tensors(out)
    wrong = sorted(n for n in disk if n not in written or not _same(written[n], disk[n]))
    return wrong + sorted(set(written) - set(disk))


def _worker(rank, world_size, folders, input_ids, layout, root, vlm):
    from megatron_hybrid.hf import iter_hf_weights, load_hf_model
    from megatron_hybrid.process_groups import reset_megatron_state
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    results = {}
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    for family, (folder, reference, bound) in folders.items():
        reset_megatron_state()
        model = load_hf_model(folder, params_dtype=torch.float32, **LAYOUTS[layout]).eval()
        diff = None
        if reference is not None and layout != "pp2":
            with torch.no_grad():
                logits = model(input_ids, positions, None)
            diff = ((logits - reference).abs().max().item(), bound)
        disk = hf_oracle.read_tensors(folder)
        streamed = dict(iter_hf_weights(model))
        wrong = [n for n in disk if n not in streamed or not _same(streamed[n], disk[n])]
        results[family] = dict(
            diff=diff,
            stream_wrong=sorted(wrong),
            stream_extra=sorted(set(streamed) - set(disk)),
            disk_wrong=None,
        )
        if family == "deepseek_v3":
            results[family]["disk_wrong"] = _round_trip(folder, root, layout)
    if vlm is not None:  # carried tensors live on rank 0 only: saved and restored so
        results["vlm"] = dict(diff=None, stream_wrong=[], stream_extra=[])
        results["vlm"]["disk_wrong"] = _round_trip(vlm, root, layout)
    reset_megatron_state()
    return results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_layout_matches_transformers_and_round_trips_bitwise(
    layout, request, input_ids, tmp_path
):
    # PP2 is about the stage split (DeepSeek-V3 with 4 layers); its logits are TP1's.
    folders = request.getfixturevalue("fp8_pp_folders" if layout == "pp2" else "fp8_folders")
    vlm = str(request.getfixturevalue("vlm_folder")) if layout == "ep2" else None
    per_rank = run_distributed(
        _worker, 2, folders, input_ids, layout, str(tmp_path), vlm, timeout=900
    )
    for rank, results in enumerate(per_rank):
        for family, result in results.items():
            where = f"{layout} rank {rank} {family}"
            assert result["stream_wrong"] == [] and result["stream_extra"] == [], where
            if result["diff"] is not None:
                diff, bound = result["diff"]
                assert diff <= bound, (where, diff, bound)
            if rank == 0 and family in ("deepseek_v3", "vlm"):
                assert result["disk_wrong"] == [], where
    if vlm is not None:
        assert per_rank[0]["vlm"]["disk_wrong"] == []
    if layout != "pp2":
        for family in folders:
            assert all(r[family]["diff"] is not None for r in per_rank), family

"""megatron_hybrid.hf on two gloo ranks: TP2, EP2 and PP2 against transformers and TP1.

A round trip proves nothing about TP (slicing GatedDeltaNet's in_proj as one block round-trips
bitwise and gives O(1) logits errors), so every layout is held to transformers' logits and its
streamed export to the checkpoint itself (which TP1's export equals bitwise, see
test_hf_convert). One spawn per layout runs every family in turn.
"""

from __future__ import annotations

import hf_oracle
import pytest
import torch
from hf_oracle import CONVERTED

from megatron_hybrid.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
}


def _pipeline_logits(model, input_ids, positions, pp_group):
    """Logits of a two-stage model: stage 0's hidden states are sent to stage 1."""
    import torch.distributed as dist

    rank = pp_group.rank()
    if rank == 0:
        hidden = model(input_ids, positions, None)
        dist.send(hidden.contiguous(), dst=dist.get_global_rank(pp_group, 1), group=pp_group)
        return None
    hidden = torch.empty(input_ids.shape[1], input_ids.shape[0], model.config.hidden_size)
    dist.recv(hidden, src=dist.get_global_rank(pp_group, 0), group=pp_group)
    model.set_input_tensor(hidden)
    return model(input_ids, positions, None)


def _worker(rank, world_size, folders, input_ids, layout):
    from megatron_hybrid.hf import iter_hf_weights, load_hf_model
    from megatron_hybrid.process_groups import reset_megatron_state
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    results = {}
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    for family, (folder, reference, bound) in folders.items():
        reset_megatron_state()
        model = load_hf_model(folder, **LAYOUTS[layout]).eval()
        with torch.no_grad():
            if layout == "pp2":
                logits = _pipeline_logits(model, input_ids, positions, model.pg_collection.pp)
            else:
                logits = model(input_ids, positions, None)
        diff = None if logits is None else (logits - reference).abs().max().item()
        diff = None if diff is None else (diff, bound)
        disk = hf_oracle.read_tensors(folder)
        exported = {}
        for name, tensor in iter_hf_weights(model):
            exported[name] = tensor.dtype == disk[name].dtype and torch.equal(tensor, disk[name])
        results[family] = dict(
            diff=diff,
            wrong=sorted(n for n, ok in exported.items() if not ok),
            missing=sorted(set(disk) - set(exported)),
            extra=sorted(set(exported) - set(disk)),
        )
    reset_megatron_state()
    return results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_transformers_and_exports_bitwise(layout, hf_folders, pp_folders, input_ids):
    folders = pp_folders if layout == "pp2" else hf_folders
    if layout == "ep2":  # only MoE families have experts to place
        folders = {f: v for f, v in folders.items() if f != "qwen3_5"}
    per_rank = run_distributed(_worker, 2, folders, input_ids, layout, timeout=900)
    for rank, results in enumerate(per_rank):
        assert set(results) == set(folders)
        for family, result in results.items():
            where = f"{layout} rank {rank} {family}"
            assert result["missing"] == [] and result["extra"] == [], where
            assert result["wrong"] == [], where
            if result["diff"] is not None:
                diff, bound = result["diff"]
                assert diff <= bound, (where, diff, bound)
    # Every family's logits were checked on some rank (PP: the last stage).
    for family in folders:
        assert any(r[family]["diff"] is not None for r in per_rank), family


def test_all_families_are_covered():
    assert set(CONVERTED) <= set(hf_oracle.FAMILIES)

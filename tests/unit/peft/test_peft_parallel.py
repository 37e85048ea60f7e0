"""Adapters on two gloo ranks (TP2 with expert-TP 2, EP2) against peft: logits, the adapter
stream bitwise the PEFT file, the merged stream; one spawn per layout runs every family."""

from __future__ import annotations

import peft_oracle
import pytest
import torch
from safetensors.torch import load_file

from megatron_hybrid.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
}


def _worker(rank, world_size, cases, input_ids, layout):
    from megatron_hybrid.hf import iter_hf_weights, load_hf_model
    from megatron_hybrid.peft import iter_lora_weights, load_peft_adapter
    from megatron_hybrid.process_groups import reset_megatron_state
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    results = {}
    for family, (hf, adapter, reference, merged) in cases.items():
        reset_megatron_state()
        model = load_peft_adapter(load_hf_model(hf, **LAYOUTS[layout]).eval(), adapter)
        with torch.no_grad():
            logits = model(input_ids, positions, None)
        diff = logits - reference
        file = load_file(adapter / "adapter_model.safetensors")
        streamed = dict(iter_lora_weights(model))
        merged_stream = dict(iter_hf_weights(model, merge_lora=True))
        results[family] = dict(
            max_abs=diff.abs().max().item(),
            rel=(diff.norm() / reference.norm()).item(),
            names=set(streamed) == set(file),
            wrong=sorted(n for n in file if not torch.equal(streamed.get(n), file[n])),
            merged=max((merged_stream[n] - t).abs().max().item() for n, t in merged.items()),
            merged_names=set(merged_stream) == set(merged),
        )
    reset_megatron_state()
    return results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_peft(layout, cases, input_ids):
    chosen = {
        family: (c.hf, c.adapter, c.logits, c.merged)
        for family, c in cases.items()
        if layout == "tp2" or family != "qwen3_5"  # EP needs experts
    }
    per_rank = run_distributed(_worker, 2, chosen, input_ids, layout, timeout=900)
    for rank, results in enumerate(per_rank):
        assert set(results) == set(chosen)
        for family, r in results.items():
            where = f"{layout} rank {rank} {family}"
            assert r["max_abs"] <= 1e-3 and r["rel"] <= 1e-4, (where, r)
            assert r["names"] and r["wrong"] == [], (where, r["wrong"])
            assert r["merged_names"] and r["merged"] <= 1e-5, (where, r["merged"])


def test_all_families_are_covered():
    assert set(peft_oracle.FAMILIES) == {
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "deepseek_v3",
        "nemotron_h",
    }

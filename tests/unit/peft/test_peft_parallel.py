"""Adapters on two gloo ranks (TP2 with sequence parallelism and expert-TP 2, EP2, PP2) against
peft and TP1: logits, the adapter stream bitwise the PEFT file, the merged stream, gradients;
one spawn runs every layout and family."""

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
    "pp2": dict(pipeline_model_parallel_size=2),
}
#: Families each layout runs: EP needs experts; PP2 splits four-layer stacks (forward only).
FAMILIES_OF = {
    "tp2": peft_oracle.FAMILIES,
    "ep2": ("qwen3_5_moe", "qwen3_next", "deepseek_v3", "nemotron_h"),
    "pp2": ("qwen3_5_moe", "nemotron_h"),
}


def _pipeline_logits(model, input_ids, positions, pp_group):
    """Logits of a two-stage model (None on the first stage)."""
    import torch.distributed as dist

    if pp_group.rank() == 0:
        hidden = model(input_ids, positions, None)
        dist.send(hidden.contiguous(), dst=dist.get_global_rank(pp_group, 1), group=pp_group)
        return None
    hidden = torch.empty(input_ids.shape[1], input_ids.shape[0], model.config.hidden_size)
    dist.recv(hidden, src=dist.get_global_rank(pp_group, 0), group=pp_group)
    model.set_input_tensor(hidden)
    return model(input_ids, positions, None)


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    """A fixed per-token loss over full logits (every layout gathers them)."""
    labels = torch.arange(logits.shape[0] * logits.shape[1]) % logits.shape[-1]
    flat = logits.float().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat, labels, reduction="sum")


def lora_grads(model, pg=None) -> dict:
    """The adapter's gradients in the PEFT names and layouts (every rank), reduced as megatron's
    DDP and ``finalize_model_grads`` reduce them: sequence-parallel partial sums over TP, dense
    gradients over data parallelism and expert ones over expert data parallelism, then the mean
    over data-parallel ranks (which all saw the same tokens here)."""
    from megatron_hybrid.peft import iter_lora_weights, lora_parameters

    params = lora_parameters(model)
    for p in params if pg is not None else ():
        if getattr(p, "sequence_parallel", False):
            torch.distributed.all_reduce(p.grad, group=pg.tp)
        torch.distributed.all_reduce(p.grad, group=pg.dp_cp if p.allreduce else pg.expt_dp)
        p.grad /= pg.dp_cp.size()
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return {n: t.clone() for n, t in iter_lora_weights(model)}
    finally:
        for p, data in zip(params, saved, strict=True):
            p.data = data


def _worker(rank, world_size, cases, input_ids, reference_grads):
    return {layout: _layout(cases[layout], input_ids, layout, reference_grads) for layout in cases}


def _layout(cases, input_ids, layout, reference_grads):
    from megatron_hybrid.hf import iter_hf_weights, load_hf_model
    from megatron_hybrid.peft import iter_lora_weights, load_peft_adapter
    from megatron_hybrid.process_groups import reset_megatron_state
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    results = {}
    for family, (hf, adapter, reference, bound, merged) in cases.items():
        reset_megatron_state()
        model = load_peft_adapter(load_hf_model(hf, **LAYOUTS[layout]).eval(), adapter)
        grads, pipelined = None, layout == "pp2"
        if pipelined:
            with torch.no_grad():
                logits = _pipeline_logits(model, input_ids, positions, model.pg_collection.pp)
        else:
            logits = model(input_ids, positions, None)
            loss_of(logits).backward()
            grads = lora_grads(model, model.pg_collection)
            logits = logits.detach()
        file = load_file(adapter / "adapter_model.safetensors")
        streamed = dict(iter_lora_weights(model))
        merged_stream = dict(iter_hf_weights(model, merge_lora=True))
        diff = None if logits is None else logits - reference
        results[family] = dict(
            max_abs=None if diff is None else diff.abs().max().item(),
            bound=bound,
            rel=None if diff is None else (diff.norm() / reference.norm()).item(),
            names=set(streamed) == set(file),
            wrong=sorted(n for n in file if not torch.equal(streamed.get(n), file[n])),
            merged=max((merged_stream[n] - t).abs().max().item() for n, t in merged.items()),
            merged_names=set(merged_stream) == set(merged),
            grads=(
                None
                if grads is None
                else max(
                    (
                        (g - reference_grads[family][n]).norm() / reference_grads[family][n].norm()
                    ).item()
                    for n, g in grads.items()
                )
            ),
            grad_names=grads is None or set(grads) == set(reference_grads[family]),
        )
    reset_megatron_state()
    return results


@pytest.fixture(scope="module")
def reference_grads(cases, input_ids, megatron_cpu):
    """The adapter's gradients at TP1 (single rank), per family."""
    from megatron_hybrid.hf import load_hf_model
    from megatron_hybrid.peft import load_peft_adapter
    from megatron_hybrid.process_groups import reset_megatron_state

    out = {}
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    for family, case in cases.items():
        reset_megatron_state()
        model = load_peft_adapter(load_hf_model(case.hf).eval(), case.adapter)
        loss_of(model(input_ids, positions, None)).backward()
        out[family] = lora_grads(model)
    reset_megatron_state()
    return out


@pytest.fixture(scope="module")
def two_ranks(cases, input_ids, reference_grads):
    """Every layout's results per rank, from one spawn."""
    chosen = {
        layout: {
            family: (c.hf, c.adapter, c.logits, c.bound, c.merged)
            for family, c in cases.items()
            if family in FAMILIES_OF[layout]
        }
        for layout in LAYOUTS
    }
    per_rank = run_distributed(_worker, 2, chosen, input_ids, reference_grads, timeout=1200)
    return chosen, per_rank


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_peft(layout, two_ranks):
    chosen, per_rank = two_ranks
    chosen = chosen[layout]
    for rank, results in enumerate(per_rank):
        results = results[layout]
        assert set(results) == set(chosen)
        for family, r in results.items():
            where = f"{layout} rank {rank} {family}"
            if r["max_abs"] is not None:  # PP: the last stage
                assert r["max_abs"] <= r["bound"] and r["rel"] <= 1e-4, (where, r)
            assert r["names"] and r["wrong"] == [], (where, r["wrong"])
            assert r["merged_names"] and r["merged"] <= 1e-5, (where, r["merged"])
            assert r["grad_names"], where
            if r["grads"] is None:
                continue
            # Gradients: TP (sequence parallel, expert-TP) and EP give TP1's; DeepSeek-V3's MLA
            # too (megatron-core's own MLA splits the RoPE key's gradient over TP without
            # summing it; modules/mla.py sums it, test_mla_tensor_parallel.py).
            assert r["grads"] <= 1e-4, (where, r["grads"])
    assert any(r[layout][f]["max_abs"] is not None for r in per_rank for f in chosen)


def test_all_families_are_covered():
    assert set(peft_oracle.FAMILIES) == {
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "deepseek_v3",
        "nemotron_h",
    }

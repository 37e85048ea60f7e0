"""EP overlap vs the plain schedule on GPUs (real streams, NCCL, bf16), next to GPTModel.

The tolerance is not invented: GPTModel's own overlap-vs-plain difference on the same data in the
same run is measured first, and a grouped pattern may differ from its plain schedule by at most
twice that, or by bf16 rounding (1e-3 relative) when GPTModel happens to match exactly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch
from conftest import layout_fits, report, require_ep_overlap

CASES = ["[*E]{2}", "[*-][*E]", "*[*E]-", "[*E]{2}/*E"]
STEPS, MICROBATCHES = 3, 4


@contextlib.contextmanager
def plans_built():
    """Counts the grouped model's schedule plans: an overlapped run that built none fell back
    to the plain schedule, and its agreement with the plain run would prove nothing."""
    from megatron_hybrid.model.hybrid_model import HybridModel

    calls, original = [0], HybridModel.build_schedule_plan

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    HybridModel.build_schedule_plan = counted
    try:
        yield calls
    finally:
        HybridModel.build_schedule_plan = original


def _p2p() -> str:
    return f"NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE', '0')}"


def _rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def _run(pattern, builder, pg, device, *, pp=1, vpp=None, ep):
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.testing.models import small_config
    from megatron_hybrid.testing.overlap import compare_overlap

    config = small_config(
        pattern, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512,
        expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )  # fmt: skip

    def build(run_config):
        torch.manual_seed(3)
        return [
            Float16Module(run_config, builder(run_config, pattern, pg, vp_stage=vp).to(device))
            for vp in ([None] if vpp is None else range(vpp))
        ]

    out = compare_overlap(build, config, steps=STEPS, lr=1e-3, num_microbatches=MICROBATCHES,
                          seq_length=128)  # fmt: skip
    return out["plain"]["losses"], out["overlap"]["losses"]


def _gather_losses(losses):
    """Losses live on the last pipeline stage; every rank gets them."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, losses)
    return next(g for g in gathered if g)


def _gpt_tolerance(ep, device):
    """GPTModel's own overlap-vs-plain difference on the same data, and the tolerance it sets."""
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_gpt_twin

    pg = initialize_model_parallel(ep=ep, seed=5)
    gpt_plain, gpt_overlap = _run("[*E]{2}", build_gpt_twin, pg, device, ep=ep)
    gpt_diff = _rel(gpt_overlap, gpt_plain)
    return gpt_diff, max(2 * gpt_diff, 1e-3)


def _grouped(pattern, ep, device):
    """Overlap vs plain of the grouped ``pattern``: the difference and the plans built."""
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_hybrid

    pg = initialize_model_parallel(ep=ep, seed=5)
    with plans_built() as plans:
        plain, overlap = _run(pattern, build_hybrid, pg, device, ep=ep)
    return _rel(overlap, plain), plans[0]


def test_overlap_matches_plain_like_gpt(world):
    rank, world_size, device = world
    require_ep_overlap(world_size)
    ep = world_size
    gpt_diff, tolerance = _gpt_tolerance(ep, device)
    rows = [("pattern", "max rel diff overlap vs plain", "tolerance", "plans built"),
            ("GPTModel [*E]{2}", f"{gpt_diff:.2e}", "-", "-")]  # fmt: skip
    failures = []
    for pattern in CASES:
        diff, plans = _grouped(pattern, ep, device)
        rows.append((pattern, f"{diff:.2e}", f"{tolerance:.2e}", plans))
        if diff > tolerance or not plans:
            failures.append(f"{pattern}: {diff:.2e}, {plans} plans")
    report(f"EP={ep} overlap vs plain, {STEPS} steps x {MICROBATCHES} micro-batches, bf16, "
           f"{_p2p()}", rows)  # fmt: skip
    assert not failures, f"overlap differs beyond GPTModel's own difference: {failures}"


def test_ge_overlap_matches_plain(world):
    """``[GE]{2}`` (GatedDeltaNet through megatron's torch path) overlapped vs plain, EP over
    every rank; test_training_gpu.py runs it again with NCCL_P2P_DISABLE=1."""
    rank, world_size, device = world
    require_ep_overlap(world_size)
    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed (megatron's GatedDeltaNet imports it)")
    ep = world_size
    gpt_diff, tolerance = _gpt_tolerance(ep, device)
    diff, plans = _grouped("[GE]{2}", ep, device)
    report(f"EP={ep} [GE]{{2}} overlap vs plain, bf16, {_p2p()}",
           [("GPTModel [*E]{2} max rel diff", f"{gpt_diff:.2e}"),
            ("[GE]{2} max rel diff", f"{diff:.2e}"), ("tolerance", f"{tolerance:.2e}"),
            ("plans built", plans)])  # fmt: skip
    assert plans, "the overlapped run built no schedule plan: it ran the plain schedule"
    assert diff <= tolerance


def test_pp2_vpp2_ep2_with_mtp(world):
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_gpt_twin, build_hybrid

    rank, world_size, device = world
    if not layout_fits(world_size, pp=2, ep=2):
        pytest.skip(f"PP2 x VPP2 x EP2 needs a multiple of 4 GPUs; this job has {world_size}")
    rows = [("model", "max rel diff overlap vs plain")]
    pg = initialize_model_parallel(pp=2, vpp=2, ep=2, seed=5)
    gpt = _run("[*E]|[*E]|[*E]|[*E]", build_gpt_twin, pg, device, pp=2, vpp=2, ep=2)
    gpt_diff = _rel(_gather_losses(gpt[1]), _gather_losses(gpt[0]))
    rows.append(("GPTModel 4 layers", f"{gpt_diff:.2e}"))
    # The last chunk holds no decoder layer, only the MTP depth (final norm applied there).
    pattern = "[*E]|[*E]|[*E]|/*E"
    pg = initialize_model_parallel(pp=2, vpp=2, ep=2, seed=5)
    with plans_built() as plans:
        plain, overlap = _run(pattern, build_hybrid, pg, device, pp=2, vpp=2, ep=2)
    diff = _rel(_gather_losses(overlap), _gather_losses(plain))
    built = torch.tensor([plans[0]], device=device)
    torch.distributed.all_reduce(built)
    rows += [(pattern, f"{diff:.2e}"), ("schedule plans built (all ranks)", built.item())]
    report(f"PP2 x VPP2 x EP2 overlap vs plain, {_p2p()}", rows)
    assert built.item(), "the overlapped run built no schedule plan: it ran the plain schedule"
    assert diff <= max(2 * gpt_diff, 1e-3)

"""Two gloo ranks: TP=2+SP, EP=2, PP=2 (pipes) and PP=2 x VPP=2 against a single-rank reference.

One spawn runs every layout in turn (a spawn costs several seconds on a small CPU machine). The
reference model is saved at TP1/PP1/EP1; each layout loads that checkpoint, must hold bitwise
the same parameters (through their checkpoint keys), and must reproduce the reference losses;
then it trains a step (forward and backward through megatron's pipeline schedules).
"""

from __future__ import annotations

import pytest
import torch

# Logical layers are the same in every layout; only the '|' stage boundaries differ, and
# checkpoint keys do not depend on them.
LAYOUTS = {
    "reference": dict(pattern="[*-][*E][*E][*-]", tp=1, pp=1, vpp=None, ep=1, sp=False),
    "tp2_sp": dict(pattern="[*-][*E][*E][*-]", tp=2, pp=1, vpp=None, ep=1, sp=True),
    "ep2": dict(pattern="[*-][*E][*E][*-]", tp=1, pp=1, vpp=None, ep=2, sp=False),
    "pp2": dict(pattern="[*-][*E]|[*E][*-]", tp=1, pp=2, vpp=None, ep=1, sp=False),
    "pp2_vpp2": dict(pattern="[*-]|[*E]|[*E]|[*-]", tp=1, pp=2, vpp=2, ep=1, sp=False),
}
SEQ, MBS, MICROBATCHES = 16, 2, 2


def _batches():
    from megatron_hybrid.testing.models import model_inputs

    batches = []
    for seed in range(MICROBATCHES):
        batch = model_inputs(batch=MBS, seq=SEQ, seed=seed)
        batch["loss_mask"] = torch.ones(MBS, SEQ)
        batches.append(batch)
    return batches


def _run_layout(name: str, checkpoint_dir: str, reference: dict | None):
    from megatron.core import dist_checkpointing
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from support.checkpoints import assemble_global_tensors, local_shard_mismatches

    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.schedule.steps import lm_forward_step
    from megatron_hybrid.testing.models import build_hybrid, small_config

    layout = LAYOUTS[name]
    pg = initialize_model_parallel(
        tp=layout["tp"], pp=layout["pp"], vpp=layout["vpp"], ep=layout["ep"], seed=7
    )
    config = small_config(
        layout["pattern"],
        tensor_model_parallel_size=layout["tp"],
        pipeline_model_parallel_size=layout["pp"],
        virtual_pipeline_model_parallel_size=layout["vpp"],
        expert_model_parallel_size=layout["ep"],
        sequence_parallel=layout["sp"],
        pipeline_dtype=torch.float32,
    )
    chunks = [None] if layout["vpp"] is None else list(range(layout["vpp"]))
    models = [build_hybrid(config, layout["pattern"], pg, vp_stage=vp) for vp in chunks]
    for model in models:
        model.config.finalize_model_grads_func = None

    def sharded():
        # One sub-dict per model chunk, as Megatron-LM stores VPP chunks ("model0", ...).
        return {f"model{i}": model.sharded_state_dict() for i, model in enumerate(models)}

    result = {}
    if reference is None:
        dist_checkpointing.save(sharded(), checkpoint_dir)
        result["params"] = assemble_global_tensors(sharded())
    else:
        state = dist_checkpointing.load(sharded(), checkpoint_dir)
        for i, model in enumerate(models):
            missing, unexpected = model.load_state_dict(state[f"model{i}"], strict=False)
            assert not unexpected, unexpected
            assert all(key.endswith("_extra_state") for key in missing), missing
        result["mismatched_shards"] = local_shard_mismatches(sharded(), reference["params"])

    iterators = [iter(_batches()) for _ in models]
    losses = get_forward_backward_func()(
        forward_step_func=lm_forward_step,
        data_iterator=iterators if len(models) > 1 else iterators[0],
        model=models if len(models) > 1 else models[0],
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=False,
    )
    result["losses"] = [(d["lm loss"][0] / d["lm loss"][1]).item() for d in losses]
    params = [p for m in models for p in m.parameters()]
    result["grads_finite"] = all(
        p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params
    )
    result["params_with_grad"] = sum(p.grad is not None for p in params)
    return result


def parallel_worker(rank: int, world_size: int, checkpoint_dir: str):
    """Run every layout on this rank; return per-layout results."""
    reference = _run_layout("reference", checkpoint_dir, None)
    results = {"reference": {"losses": reference["losses"]}}
    for name in ("tp2_sp", "ep2", "pp2", "pp2_vpp2"):
        results[name] = _run_layout(name, checkpoint_dir, reference)
    return results


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    pytest.importorskip("psutil")
    from megatron_hybrid.testing.spawn import run_distributed

    checkpoint_dir = str(tmp_path_factory.mktemp("tp1_checkpoint"))
    # The workers enable CPU emulation themselves (fresh spawned processes).
    return run_distributed(_emulated_worker, 2, checkpoint_dir, timeout=600)


def _emulated_worker(rank, world_size, checkpoint_dir):
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    return parallel_worker(rank, world_size, checkpoint_dir)


LAYOUT_IDS = ["tp2_sp", "ep2", "pp2", "pp2_vpp2"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_checkpoint_loads_bitwise(parallel_results, layout):
    for rank_result in parallel_results:
        assert rank_result[layout]["mismatched_shards"] == []


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_losses_match_single_rank(parallel_results, layout):
    reference = parallel_results[0]["reference"]["losses"]
    # The last pipeline stage reports the losses; other stages report none.
    reported = [r[layout]["losses"] for r in parallel_results if r[layout]["losses"]]
    assert reported, f"no rank reported losses for {layout}"
    for losses in reported:
        # TP and EP change reduction order only; fp32 agrees to rounding.
        assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_backward_reaches_every_parameter(parallel_results, layout):
    for rank_result in parallel_results:
        assert rank_result[layout]["grads_finite"]
        assert rank_result[layout]["params_with_grad"] > 0

"""EP overlap against the plain schedule on gloo ranks (bf16, dummy streams: numerics only).

Both runs start from the same weights and see the same micro-batches for two SGD steps. The
overlapped schedule reorders work across micro-batches, never the arithmetic of one, so losses
and gradients must be identical — with one exception: a parameter that receives gradient from
two different slots (the word embedding of a model with MTP: the decoder input and the MTP
depth's shifted-token embedding) accumulates the two bf16 contributions in another order; it
must agree to bf16 rounding, and the losses of later steps, which see the updated embedding,
to a relative 2e-3 (one SGD step on an embedding that differs by bf16 rounding).

Regression cases for upstream bug classes (docs/ep_overlap.md):
* ``mtp``: the decoder-output chunks kept for MTP cross slots; running their graph backward twice
  would double the decoder's gradients, which must instead equal the plain schedule's.
* ``recompute_pre_mlp_norm``: selective 'layernorm' recompute with overlap gives the gradients of
  the plain schedule (a second recompute hook in combine corrupted them upstream).
"""

from __future__ import annotations

import pytest
import torch

TWO_RANKS = {
    "group_moe": dict(pattern="[*E]{2}", gpt_twin=True),
    "dense_then_moe": dict(pattern="[*-][*E]"),
    "plain_layers_around_group": dict(pattern="*[*E]-"),
    "mtp": dict(pattern="[*E]{2}/*E", tolerant=("embedding.word_embeddings.weight",)),
    "gated_delta_net": dict(pattern="[GE]{2}", needs="fla"),
    "recompute_pre_mlp_norm": dict(
        pattern="[*E]{2}",
        overlap_overrides=dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    ),
    # With delay_wgrad_compute. Local linears compute their weight gradients in backward (their
    # backward_dw does nothing), so these only show that the schedule runs with it and that the
    # gradients stay those of the plain schedule; which slot covers which linear is checked in
    # test_callables.py, TE's real delayed wgrad on GPUs (tests/functional/test_te_backend_gpu.py).
    "delay_wgrad_compute": dict(
        pattern="[*-][*E]/*E",
        tolerant=("embedding.word_embeddings.weight",),
        overlap_overrides=dict(delay_wgrad_compute=True),
    ),
    # Under megatron's DDP, as in training: gradients read from its main_grad buffers, into which
    # (with delay_wgrad_compute) its wgrad hooks rather than autograd's accumulate. compare_bare:
    # also against the bare model, so main_grad must hold each step's own gradients.
    "delay_wgrad_compute_ddp": dict(
        pattern="[*E]{2}",
        ddp=True,
        compare_bare=True,
        overlap_overrides=dict(delay_wgrad_compute=True),
    ),
    "delay_wgrad_compute_ddp_mtp": dict(
        pattern="[*-][*E]/*E",
        ddp=True,
        compare_bare=True,
        tolerant=("embedding.word_embeddings.weight",),
        overlap_overrides=dict(delay_wgrad_compute=True),
    ),
    "delay_wgrad_compute_gdn_shared_experts": dict(
        pattern="[GE][*E]",
        needs="fla",
        config=dict(moe_shared_expert_intermediate_size=64),
        overlap_overrides=dict(delay_wgrad_compute=True),
    ),
}
# PP2 x VPP2 x EP2 (with an empty last chunk before MTP) runs on GPUs in
# tests/functional/test_ep_overlap.py: under CPU emulation megatron-core's interleaved combined-1F1B
# schedule diverges from the plain interleaved schedule for GPTModel as well (dummy streams), so a
# CPU comparison there would test the emulation, not this package.


def _build(case, pg, gpt=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.testing.models import build_gpt_twin, build_hybrid

    chunks = [None] if case.get("vpp") is None else list(range(case["vpp"]))
    builder = build_gpt_twin if gpt else build_hybrid

    def build(config):
        torch.manual_seed(3)
        models = [
            Float16Module(config, builder(config, case["pattern"], pg, vp_stage=vp))
            for vp in chunks
        ]
        if not case.get("ddp"):
            return models
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, delay_wgrad_compute=config.delay_wgrad_compute
        )
        return [DistributedDataParallel(config, ddp_config, m, pg_collection=pg) for m in models]

    return build


def overlap_worker(rank, world_size, cases):
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import small_config
    from megatron_hybrid.testing.overlap import compare_overlap, rel_error

    results = {}
    for name, case in cases.items():
        if case.get("needs") == "fla":
            try:
                import fla  # noqa: F401
            except ImportError:
                results[name] = None
                continue
        pp, vpp = case.get("pp", 1), case.get("vpp")
        pg = initialize_model_parallel(pp=pp, vpp=vpp, ep=2, seed=5)
        config = small_config(
            case["pattern"],
            expert_model_parallel_size=2,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            bf16=True,
            params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
            **case.get("config", {}),
        )
        out = compare_overlap(
            _build(case, pg),
            config,
            steps=2,
            lr=1e-2,
            num_microbatches=4,
            overlap_overrides=case.get("overlap_overrides"),
        )
        plain, overlap = out["plain"], out["overlap"]
        tolerant = case.get("tolerant", ())
        # With a tolerant parameter the weights differ slightly after the first update, so only
        # the first step's gradients can be compared exactly.
        steps = [0] if tolerant else range(len(plain["grads"]))
        inexact, errors = [], {}
        for step in steps:
            ours, ref = overlap["grads"][step], plain["grads"][step]
            for key, grad in ref.items():
                if key.endswith(tolerant):
                    errors[f"step{step}.{key}"] = rel_error(ours[key], grad)
                elif not torch.equal(ours.get(key), grad):
                    inexact.append(f"step{step}.{key}")
        results[name] = {
            "plain_losses": plain["losses"],
            "overlap_losses": overlap["losses"],
            "grad_keys_equal": all(
                a.keys() == b.keys() for a, b in zip(plain["grads"], overlap["grads"], strict=True)
            ),
            "num_grads": len(plain["grads"][0]),
            "inexact": inexact,
            "tolerant_errors": errors,
        }
        if case.get("compare_bare"):
            # DDP's main_grad (fp32) against the bare model's .grad, plain schedule, weights held
            # (lr 0: after an update the two differ by bf16 rounding, which can flip a routing
            # decision, e.g. in the MTP depth's MoE, and move gradient between experts). Each
            # step's gradients must be that step's own: a main_grad kept from the step before
            # would add that step's (other micro-batches) to them.
            held = {}
            for ddp in (True, False):
                run = compare_overlap(
                    _build({**case, "ddp": ddp}, pg), config, steps=2, lr=0.0,
                    num_microbatches=4, schedules=("plain",),
                )  # fmt: skip
                held[ddp] = run["plain"]["grads"]
            results[name]["ddp_vs_bare"] = max(
                rel_error(grad, grads[key.replace("module.module.", "module.", 1)])
                for ddp_grads, grads in zip(held[True], held[False], strict=True)
                for key, grad in ddp_grads.items()
            )
        if case.get("gpt_twin"):
            # GPTModel with the same weights under the same overlapped schedule.
            gpt = compare_overlap(
                _build(case, pg, gpt=True), config, steps=2, lr=1e-2, num_microbatches=4
            )
            results[name]["gpt_overlap_losses"] = gpt["overlap"]["losses"]
    return results


def _spawn(world_size, cases):
    from megatron_hybrid.testing.spawn import run_distributed

    return run_distributed(overlap_worker, world_size, cases, timeout=1200)


@pytest.fixture(scope="module")
def two_rank_results():
    return _spawn(2, TWO_RANKS)


def _check(rank_results, name, case):
    reported = False
    for results in rank_results:
        result = results[name]
        if result is None:
            pytest.skip("GatedDeltaNet needs fla-core (pip install fla-core==0.6.0)")
        assert result["grad_keys_equal"] and result["num_grads"] > 0
        assert result["inexact"] == []
        for key, error in result["tolerant_errors"].items():
            assert error < 8e-3, f"{key}: relative error {error:.2e} exceeds bf16 rounding"
        plain, overlap = result["plain_losses"], result["overlap_losses"]
        if not plain:
            continue  # not the last pipeline stage
        reported = True
        first_step = len(plain) // 2
        assert overlap[:first_step] == plain[:first_step]
        if case.get("tolerant"):
            assert overlap == pytest.approx(plain, rel=2e-3)
        else:
            assert overlap == plain
        if case.get("gpt_twin"):
            assert result["gpt_overlap_losses"] == overlap
        if case.get("compare_bare"):  # bf16 .grad vs fp32 main_grad: bf16 rounding (~4e-3)
            assert result["ddp_vs_bare"] < 1e-2, result["ddp_vs_bare"]
    assert reported, "no rank reported losses"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_overlap_matches_plain_ep2(two_rank_results, name):
    _check(two_rank_results, name, TWO_RANKS[name])


@pytest.mark.parametrize(
    "schedules", [(), ("plain", "fast"), ("plain", "plain")], ids=["none", "unknown", "twice"]
)
def test_compare_overlap_refuses_unknown_schedules(schedules):
    from megatron_hybrid.testing.overlap import compare_overlap

    with pytest.raises(ValueError, match="schedules must name 'plain' and/or 'overlap'"):
        compare_overlap(lambda config: [], None, schedules=schedules)

"""LoRA under the EP-overlap plan (combined 1F1B, EP2, gloo, bf16): the overlapped schedule
gives the plain schedule's losses and adapter gradients, MTP depth and shared experts included;
under megatron's DDP only the adapters have gradient buffers."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PATTERN = "[*E]{2}/*E"


def _build(pg):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.peft import LoRAConfig, apply_lora, lora_parameters
    from megatron_hybrid.testing.models import build_hybrid

    def build(config):
        torch.manual_seed(3)
        model = Float16Module(config, build_hybrid(config, PATTERN, pg))
        # MTP layers take adapters only where a target names them (all-linear leaves them out).
        apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=("decoder.*", "mtp.*")))
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():  # B != 0, the same in both runs (the base is rebuilt from seed 3)
            for param in lora_parameters(model):
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        return [DistributedDataParallel(config, ddp, model, pg_collection=pg)]

    return build


def _worker(rank, world_size):
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import small_config
    from megatron_hybrid.testing.overlap import compare_overlap

    pg = initialize_model_parallel(ep=2, seed=5)
    config = small_config(
        PATTERN,
        expert_model_parallel_size=2,
        moe_shared_expert_intermediate_size=64,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )
    # lr 0: the base is frozen and only the adapters would move; one step holds the weights.
    out = compare_overlap(_build(pg), config, steps=1, lr=0.0, num_microbatches=4)
    plain, overlap = out["plain"], out["overlap"]
    grads = plain["grads"][0]
    return {
        "losses": (plain["losses"], overlap["losses"]),
        "names": sorted(grads),
        "inexact": [k for k, g in grads.items() if not torch.equal(overlap["grads"][0][k], g)],
        "nonzero": sum(1 for g in grads.values() if g.abs().sum() > 0),
    }


def test_overlap_gives_the_plain_schedules_adapter_gradients():
    from megatron_hybrid.testing.spawn import run_distributed

    for result in run_distributed(_worker, 2, timeout=900):
        plain, overlap = result["losses"]
        assert plain and overlap == plain
        assert result["names"] and all(".lora." in n for n in result["names"])  # only adapters
        assert any(".mtp." in n for n in result["names"])  # the MTP depth's adapters train
        assert result["inexact"] == []
        assert result["nonzero"] > len(result["names"]) // 2

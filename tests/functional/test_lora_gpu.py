"""LoRA with the TransformerEngine backend on GPUs against the math of the ``local`` backend.

* TE linears (fused layer-norm + linear for ``linear_qkv`` / ``linear_fc1``, TE column/row
  linears, experts as TE linears in ``SequentialMLP``) against the local backend: the same base
  (a ``torch_dist`` checkpoint of the local model) and the same adapters (an adapter checkpoint,
  whose keys are the base's), float32 with TF32 off: logits and adapter gradients agree.
* TE's grouped-GEMM experts (``TEGroupedMLP``, ``forward(x, m_splits)``): the adapted model's
  logits equal the same model with the adapters merged into its weights (``W + scale B A``,
  the ``lora_delta`` of each weight) and switched off.

Every rank runs TP1 / EP1 (data-parallel replicas), so the tests run on 1, 2 and 4 GPUs; they
skip with the reason where TransformerEngine is not installed.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import ON_CPU, device_inputs, exact_float32, report

pytestmark = pytest.mark.skipif(ON_CPU, reason="TransformerEngine kernels need CUDA GPUs")

PATTERN = "[*-][*E]"
TOLERANCE = 1e-4


def _config(**changes):
    from megatron_hybrid.testing.models import small_config

    return small_config(PATTERN, hidden_size=128, num_attention_heads=8, ffn_hidden_size=256,
                        normalization="RMSNorm", **changes)  # fmt: skip


def _model(config, pg, backend, device):
    from megatron_hybrid.testing.models import build_hybrid

    torch.manual_seed(1)
    return build_hybrid(config, PATTERN, pg, backend=backend).to(device)


def _randomise_adapters(model, seed=7):
    from megatron_hybrid.peft import lora_parameters

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in lora_parameters(model):
            value = 0.05 * torch.randn(param.shape, generator=generator)
            param.copy_(value.to(param.device, param.dtype))


def _run(model, device):
    """Per-token losses of a fixed batch and the adapters' gradients by parameter name (both
    backends give the adapted linears the same module paths)."""
    inputs = device_inputs(device, batch=2, seq=64, seed=3)
    model.zero_grad(set_to_none=True)
    losses = model(**inputs)
    losses.float().sum().backward()
    grads = {
        name: param.grad.detach().float().clone()
        for name, param in model.named_parameters()
        if param.requires_grad and param.grad is not None
    }
    return losses.detach().float(), grads


def test_te_lora_equals_local_math(world, shared_dir):
    pytest.importorskip("transformer_engine", reason="TransformerEngine is not installed")
    from megatron.core import dist_checkpointing

    from megatron_hybrid.peft import LoRAConfig, apply_lora
    from megatron_hybrid.peft.checkpoint import load_adapter_state, lora_sharded_state
    from megatron_hybrid.process_groups import initialize_model_parallel

    _, _, device = world
    pg = initialize_model_parallel(seed=2)
    config = _config()
    lora = LoRAConfig(rank=4, alpha=8)
    with exact_float32():
        local = apply_lora(_model(config, pg, "local", device), lora)
        _randomise_adapters(local)
        te = _model(config, pg, "te", device)
        # dist_checkpointing.save writes into an existing, empty folder.
        for sub in ("base", "adapters"):
            os.makedirs(f"{shared_dir}/{sub}", exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(local.sharded_state_dict(), f"{shared_dir}/base")
        state = dist_checkpointing.load(te.sharded_state_dict(), f"{shared_dir}/base")
        missing, unexpected = te.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
        apply_lora(te, lora)
        linears = [c.module for c in te.lora_state.adapted]
        assert any(type(m).__name__ == "TELayerNormColumnParallelLinear" for m in linears)
        dist_checkpointing.save(lora_sharded_state(local), f"{shared_dir}/adapters")
        loaded = dist_checkpointing.load(lora_sharded_state(te), f"{shared_dir}/adapters")
        load_adapter_state(te, loaded)
        local_losses, local_grads = _run(local, device)
        te_losses, te_grads = _run(te, device)
    loss_diff = ((te_losses - local_losses).abs().max() / local_losses.abs().max()).item()
    assert te_grads.keys() == local_grads.keys() and te_grads
    grad_diff = max(
        ((te_grads[k] - g).norm() / g.norm().clamp_min(1e-30)).item()
        for k, g in local_grads.items()
    )
    report("LoRA: TE backend vs local (float32, TF32 off)",
           [("max rel loss diff", f"{loss_diff:.2e}"), ("max rel adapter grad diff",
                                                        f"{grad_diff:.2e}")])  # fmt: skip
    assert loss_diff <= TOLERANCE and grad_diff <= 10 * TOLERANCE


def test_te_grouped_gemm_lora_equals_merged_weights(world):
    pytest.importorskip("transformer_engine", reason="TransformerEngine is not installed")
    from megatron_hybrid.hf.weights import LORA_DELTA
    from megatron_hybrid.peft import LoRAConfig, apply_lora, disable_lora
    from megatron_hybrid.process_groups import initialize_model_parallel

    _, _, device = world
    pg = initialize_model_parallel(seed=2)
    with exact_float32():
        model = _model(_config(moe_grouped_gemm=True), pg, "te", device)
        apply_lora(model, LoRAConfig(rank=4, alpha=8))
        grouped = [c for c in model.lora_state.adapted if c.info.grouped]
        assert grouped, "no grouped-GEMM expert linear took an adapter"
        _randomise_adapters(model)
        inputs = device_inputs(device, batch=2, seq=64, seed=3)
        with torch.no_grad():
            adapted = model(**inputs).float()
            with disable_lora(model):
                base = model(**inputs).float()
            for cand in model.lora_state.adapted:
                for weight in cand.info.weights:
                    weight.add_(getattr(weight, LORA_DELTA)().to(weight.dtype))
            with disable_lora(model):
                merged = model(**inputs).float()
        losses = model(**inputs)
        losses.float().sum().backward()
    expert_grads = [p.grad for c in grouped for p in c.module.lora.parameters()]
    effect = ((adapted - base).abs().max() / base.abs().max()).item()
    diff = ((merged - adapted).abs().max() / adapted.abs().max()).item()
    report("LoRA on TE grouped-GEMM experts vs merged weights",
           [("adapter effect", f"{effect:.2e}"), ("max rel diff", f"{diff:.2e}")])  # fmt: skip
    assert effect > 100 * TOLERANCE and diff <= TOLERANCE
    assert any(g is not None and g.abs().sum() > 0 for g in expert_grads)

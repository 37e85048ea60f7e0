"""LoRA with the TransformerEngine backend on GPUs against the math of the ``local`` backend.

* TE linears (fused layer-norm + linear for ``linear_qkv`` / ``linear_fc1``, TE column/row
  linears, experts as TE linears in ``SequentialMLP``) against the local backend: the same base
  (a ``torch_dist`` checkpoint of the local model) and the same adapters (an adapter checkpoint,
  whose keys are the base's), float32 with TF32 off: logits and adapter gradients agree.
* TE's grouped-GEMM experts (``TEGroupedMLP``, ``forward(x, m_splits)``): the adapted model's
  logits equal the same model with the adapters merged into its weights (``W + scale B A``,
  the ``lora_delta`` of each weight) and switched off.

Those two run TP1 / EP1 on every rank (data-parallel replicas), so they run on 1, 2 and 4 GPUs;
they skip with the reason where TransformerEngine is not installed.

* Layouts (2 or 4 GPUs, NCCL): base and adapters saved at TP1 and loaded at TP2 + SP and EP2
  (local backend), and at TP2 + SP with TE's duplicated MLA down-projections (TE only), give
  TP1's losses and adapter gradients shard by shard.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import ON_CPU, device_inputs, exact_float32, rel_error, report

needs_te_kernels = pytest.mark.skipif(ON_CPU, reason="TransformerEngine kernels need CUDA GPUs")

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


def _read_moe_norms_from_local_names(sharded) -> list[str]:
    """Point the TE model's MoE pre-MLP norms (``pre_mlp_layernorm.*``, TE's separate norm) at
    the names the local backend saves them under (GPT's local spec: ``mlp.linear_fc1.
    layer_norm_*``); the renamed checkpoint keys."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    renamed = []
    for value in nested_values(sharded):
        key = getattr(value, "key", "")
        if ".pre_mlp_layernorm." in key and not key.endswith("_extra_state"):
            value.key = key.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")
            renamed.append(key)
    return renamed


@needs_te_kernels
def test_te_lora_equals_local_math(world, shared_dir):
    pytest.importorskip("transformer_engine", reason="TransformerEngine is not installed")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

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
        # Local and TE checkpoints differ (docs/checkpoints.md, rule 6): the local one has no TE
        # _extra_state, and it keeps an MoE layer's pre-MLP norm as GPT's local spec does, under
        # mlp.linear_fc1.layer_norm_* (TE: pre_mlp_layernorm.*). Read that norm from there;
        # megatron leaves out what the checkpoint lacks and names it.
        request = te.sharded_state_dict()
        renamed = _read_moe_norms_from_local_names(request)
        assert renamed, "the [*E] layer's pre-MLP norm was not found"
        state, _, absent = dist_checkpointing.load(
            request, f"{shared_dir}/base", strict=StrictHandling.RETURN_ALL
        )
        assert all("_extra_state" in k for k in absent), sorted(absent)
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


@needs_te_kernels
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


#: TP1 -> these layouts (NCCL, float32, TF32 off): ``name -> (parallel sizes, backend, pattern)``.
#: ``tp2-sp-te-mla``: TE's duplicated MLA down-projections (TELinear ``parallel_mode=
#: "duplicated"``), whose adapters are sequence-parallel under SP, and ``SequentialMLP``'s TE
#: expert linears at expert-TP 2, whose TP communication the dispatcher does (TE mode None).
LORA_LAYOUTS = {
    "tp2-sp": (dict(tp=2), "local", PATTERN),
    "ep2": (dict(ep=2), "local", PATTERN),
    "tp2-sp-te-mla": (dict(tp=2), "te", "[+-][+E]"),
}


def _layout_config(pattern, sizes, **changes):
    """:func:`_config` of ``pattern`` at ``sizes`` (TP with sequence parallelism); MLA fields
    where the pattern has ``+``."""
    from megatron_hybrid.testing.models import small_config

    tp, ep = sizes.get("tp", 1), sizes.get("ep", 1)
    config = small_config(
        pattern, hidden_size=128, num_attention_heads=8, ffn_hidden_size=256,
        normalization="RMSNorm", tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp, **changes,
    )  # fmt: skip
    if "+" not in pattern:
        return config
    import dataclasses

    from megatron.core.transformer import MLATransformerConfig

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields.update(
        multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16,
        qk_pos_emb_head_dim=16, v_head_dim=16, rope_type="rope",
    )  # fmt: skip
    return MLATransformerConfig(**fields)


def _adapter_grads(model, pg=None) -> list[tuple]:
    """``(checkpoint entry, gradient)`` of every adapter parameter of this rank, the gradients
    reduced as megatron's DDP and ``finalize_model_grads`` reduce them (sequence-parallel partial
    sums over TP, dense gradients over data parallelism, expert ones over expert data
    parallelism, then the mean over data-parallel ranks, which all saw the same batch)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_hybrid.peft import lora_parameters
    from megatron_hybrid.peft.checkpoint import lora_sharded_state

    for p in lora_parameters(model) if pg is not None else ():
        if getattr(p, "sequence_parallel", False):
            torch.distributed.all_reduce(p.grad, group=pg.tp)
        torch.distributed.all_reduce(p.grad, group=pg.dp_cp if p.allreduce else pg.expt_dp)
        p.grad /= pg.dp_cp.size()
    params = dict(model.named_parameters())
    entries = lora_sharded_state(model)["model"]
    return [(entry, params[name].grad.detach().float().cpu()) for name, entry in entries.items()
            if isinstance(entry, ShardedTensor) and params[name].grad is not None]  # fmt: skip


def _global_grads(pairs) -> dict[str, torch.Tensor]:
    """Checkpoint key -> the whole gradient (TP1: every part is on this rank)."""
    out: dict[str, torch.Tensor] = {}
    for entry, grad in pairs:
        buf = out.setdefault(entry.key, torch.zeros(entry.global_shape))
        buf[entry.global_slice()] = grad.reshape(buf[entry.global_slice()].shape)
    return out


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_layout_equals_tp1(world, shared_dir, name):
    """Base and adapters saved at TP1, loaded at TP2 + SP / EP2 (and TE MLA at TP2 + SP): the
    same per-token losses and, shard by shard, the same adapter gradients (NCCL, float32, TF32
    off). Controls: the adapters change the losses (the comparison is not of the base alone),
    and one rank's adapter shard with its sign flipped leaves the tolerance."""
    from megatron.core import dist_checkpointing

    from megatron_hybrid.peft import LoRAConfig, apply_lora, disable_lora
    from megatron_hybrid.peft.checkpoint import load_adapter_state, lora_sharded_state
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_hybrid

    rank, world_size, device = world
    sizes, backend, pattern = LORA_LAYOUTS[name]
    if world_size < 2:
        pytest.skip(f"{name} needs 2 or 4 GPUs; this job has 1")
    if backend == "te":
        if ON_CPU:
            pytest.skip("TransformerEngine kernels need CUDA GPUs")
        pytest.importorskip("transformer_engine", reason="TransformerEngine is not installed")
    lora = LoRAConfig(rank=4, alpha=8)
    base, adapters = f"{shared_dir}/base", f"{shared_dir}/adapters"

    def build(pg, config):
        torch.manual_seed(1)
        return build_hybrid(config, pattern, pg, backend=backend).to(device)

    with exact_float32():
        pg1 = initialize_model_parallel(seed=2)
        reference = apply_lora(build(pg1, _layout_config(pattern, {})), lora)
        _randomise_adapters(reference)
        for folder in (base, adapters):
            os.makedirs(folder, exist_ok=True)  # dist_checkpointing.save wants it there
        torch.distributed.barrier()
        dist_checkpointing.save(reference.sharded_state_dict(), base)
        dist_checkpointing.save(lora_sharded_state(reference), adapters)
        ref_losses, _ = _run(reference, device)
        ref_grads = _global_grads(_adapter_grads(reference))
        with torch.no_grad(), disable_lora(reference):
            base_losses = reference(**device_inputs(device, batch=2, seq=64, seed=3)).float()

        pg = initialize_model_parallel(**sizes, seed=2)
        model = build(pg, _layout_config(pattern, sizes))
        state = dist_checkpointing.load(model.sharded_state_dict(), base)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
        apply_lora(model, lora)
        load_adapter_state(model, dist_checkpointing.load(lora_sharded_state(model), adapters))
        losses, _ = _run(model, device)
        pairs = _adapter_grads(model, pg)
        # Control: this rank's first adapter shard with its sign flipped (rank 0 only).
        first = next(iter(p for n, p in model.named_parameters() if p.requires_grad))
        with torch.no_grad():
            if rank == 0:
                first.neg_()
            flipped = model(**device_inputs(device, batch=2, seq=64, seed=3)).float()

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    loss_diff, effect = rel(losses, ref_losses), rel(ref_losses, base_losses)
    # The flipped shard moves rank 0's losses (and its TP group's): the largest over ranks.
    control = torch.tensor([rel(flipped, ref_losses)], device=device)
    torch.distributed.all_reduce(control, op=torch.distributed.ReduceOp.MAX)
    control = control.item()
    grad_errors = {f"{e.key}{tuple(e.global_offset)}":
                   rel_error(g.reshape(ref_grads[e.key][e.global_slice()].shape),
                             ref_grads[e.key][e.global_slice()]) for e, g in pairs}  # fmt: skip
    worst = max(grad_errors, key=grad_errors.get)
    tp_sp = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)
             and p.requires_grad]  # fmt: skip
    report(f"LoRA {name} ({backend}) vs TP1, {world_size} ranks, float32 (TF32 off)",
           [("max rel loss diff", f"{loss_diff:.2e}"),
            ("adapter effect on the loss", f"{effect:.2e}"),
            ("adapter shards compared", len(grad_errors)),
            ("max rel adapter grad diff", f"{grad_errors[worst]:.2e} ({worst})"),
            ("sequence-parallel adapters", len(tp_sp)),
            ("control: rank 0's shard flipped, rel loss diff", f"{control:.2e}")])  # fmt: skip
    assert all(ref.norm() > 0 for ref in ref_grads.values()), "a reference gradient is zero"
    assert effect > 100 * TOLERANCE, "the adapters do not change the losses: nothing compared"
    assert loss_diff <= TOLERANCE and grad_errors[worst] <= 10 * TOLERANCE, (loss_diff, worst)
    assert control > 100 * TOLERANCE
    if backend == "te":
        assert tp_sp, "no sequence-parallel adapter: the duplicated down-projections were missed"

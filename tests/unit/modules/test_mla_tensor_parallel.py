"""MLA ('+') on the local backend at TP2 (with and without sequence parallelism) gives TP1's
gradients, every parameter's, on two gloo ranks; the negative control is megatron-core 0.19.2's
own MLASelfAttention, which splits the RoPE key's gradient over TP without summing it.

Both models hold float64 weights, the same values, and see the same tokens. TP only regroups
the sums of the forward and backward passes (a few thousand terms here: ``n * eps64 ~ 1e-12``
relative to the magnitudes summed), but megatron-core computes some steps in float32 whatever
the parameters' dtype (the vocab-parallel cross-entropy casts the logits, softmaxes run in
float32), and a value that rounds to a neighbouring float32 on one side moves the result by up to
``eps32 = 6e-8`` of its size. The bound, 1e-6 of each tensor's largest gradient, allows some
such flips; the defect moves the RoPE key's rows of ``linear_kv_down_proj`` by about half their
size (each rank sees the gradient of its own heads only).

Under sequence parallelism ``linear_kv_up_proj`` all-gathers its input over the sequence, which
NCCL refuses unless it is contiguous (gloo here accepts it, so the test looks at the input
itself): without a KV norm ours puts a contiguous copy in the norm's place; the control puts
megatron-core's ``IdentityOp`` back and the input is a non-contiguous slice.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hybrid.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PATTERN = "[+-]"
SEQ, BATCH, VOCAB = 8, 2, 128
BOUND = 1e-6
ROPE = 8  # qk_pos_emb_head_dim: the last rows of linear_kv_down_proj
#: name -> (tensor parallel size, sequence parallel, megatron-core's MLA instead of ours)
LAYOUTS = {
    "tp2": (2, False, False),
    "tp2_sp": (2, True, False),
    "tp2_megatron_core": (2, False, True),
    "tp2_sp_megatron_core": (2, True, True),
    "tp2_sp_identity_kv_norm": (2, True, "identity"),
}


def _config(tp: int, sp: bool):
    from megatron.core.transformer import MLATransformerConfig

    from megatron_hybrid.testing.models import small_config

    config = small_config(PATTERN, tensor_model_parallel_size=tp, sequence_parallel=sp,
                          params_dtype=torch.float64)  # fmt: skip
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields.update(
        multi_latent_attention=True,
        q_lora_rank=24,  # the query down-projection (column-parallel too) is exercised as well
        kv_lora_rank=32,
        qk_head_dim=16,
        qk_pos_emb_head_dim=ROPE,
        v_head_dim=16,
        rope_type="rope",
    )
    return MLATransformerConfig(**fields)


def _global_grads(model, pg, sp: bool) -> dict[str, torch.Tensor]:
    """Checkpoint key -> the whole gradient, assembled from every TP rank's shard (the
    sequence-parallel partial sums of replicated weights reduced first, as megatron's
    ``finalize_model_grads`` reduces them)."""
    from support.checkpoints import grads_by_checkpoint_key

    for param in model.parameters():
        if sp and getattr(param, "sequence_parallel", False) and param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=pg.tp)
    shapes = {}
    for value in model.sharded_state_dict().values():
        if hasattr(value, "global_shape"):
            shapes[value.key] = tuple(value.global_shape)
    local = {k: g.detach().clone() for k, g in grads_by_checkpoint_key(model).items()}
    parts: list = [None] * pg.tp.size()
    torch.distributed.all_gather_object(parts, local, group=pg.tp)
    out = {}
    for part in parts:
        for (key, offset), grad in part.items():
            whole = out.setdefault(key, torch.zeros(shapes[key], dtype=grad.dtype))
            lead = len(offset) - grad.dim()  # a stacked layer axis megatron prepends
            boxes = (slice(o, o + s) for o, s in zip(offset[lead:], grad.shape, strict=True))
            whole[(*offset[:lead], *boxes)] = grad
    return out


def _run(tp: int, sp: bool, control, weights):
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from support.checkpoints import assemble_global_tensors

    from megatron_hybrid.modules import specs
    from megatron_hybrid.process_groups import initialize_model_parallel, reset_megatron_state
    from megatron_hybrid.testing.models import build_hybrid, model_inputs

    reset_megatron_state()
    pg = initialize_model_parallel(tp=tp, seed=7)
    ours = specs.HybridMLASelfAttention
    megatron_core_mla = control is True
    if megatron_core_mla:  # the negative control: megatron-core's class in the local spec
        specs.HybridMLASelfAttention = MLASelfAttention
    try:
        model = build_hybrid(_config(tp, sp), PATTERN, pg, vocab_size=VOCAB).double()
    finally:
        specs.HybridMLASelfAttention = ours
    assert any(type(m) is (MLASelfAttention if megatron_core_mla else ours)
               for m in model.modules())  # fmt: skip
    contiguous = []
    for module in model.modules():
        if isinstance(module, MLASelfAttention):
            if control == "identity":  # the contiguity control: megatron-core's IdentityOp back
                module.kv_layernorm = IdentityOp()
            module.linear_kv_up_proj.register_forward_pre_hook(
                lambda _, args: contiguous.append(args[0].is_contiguous())
            )
    state = model.sharded_state_dict()
    if weights is None:
        weights = assemble_global_tensors(state)
    with torch.no_grad():
        for value in state.values():
            if hasattr(value, "global_slice"):
                value.data.copy_(weights[value.key][value.global_slice()].view_as(value.data))
    batch = model_inputs(batch=BATCH, seq=SEQ, vocab=VOCAB, seed=3)
    loss = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"])
    loss.sum().backward()
    assert contiguous, "linear_kv_up_proj never ran"
    return weights, _global_grads(model, pg, sp), all(contiguous)


def _worker(rank: int, world_size: int):
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    weights, reference, _ = _run(1, False, False, None)
    results = {}
    for name, (tp, sp, control) in LAYOUTS.items():
        _, grads, contiguous = _run(tp, sp, control, weights)
        assert set(grads) == set(reference), set(grads) ^ set(reference)
        results[name] = {key: _error(grads[key], ref) for key, ref in reference.items()}
        kv = next(k for k in reference if k.endswith("linear_kv_down_proj.weight"))
        results[name]["rope rows"] = _error(
            grads[kv][..., -ROPE:, :], reference[kv][..., -ROPE:, :]
        )
        results[name]["up-projection input contiguous"] = float(contiguous)
    return results


def _error(grad: torch.Tensor, reference: torch.Tensor) -> float:
    return ((grad - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def errors():
    """Layout -> checkpoint key -> max |TP2 - TP1| / max |TP1| of that gradient (rank 0's)."""
    return run_distributed(_worker, 2, timeout=600)[0]


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_mla_gradients_at_tp2_equal_tp1(layout, errors):
    contiguous = errors[layout].pop("up-projection input contiguous")
    if LAYOUTS[layout][1]:  # sequence parallel: the up-projection gathers its input
        assert contiguous == 1.0, "linear_kv_up_proj got a non-contiguous input (NCCL refuses it)"
    worst = max(errors[layout].items(), key=lambda item: item[1])
    assert worst[1] <= BOUND, worst
    assert len(errors[layout]) > 10  # every parameter compared, not a few


@pytest.mark.parametrize("layout", ["tp2_megatron_core", "tp2_sp_megatron_core"])
def test_negative_control_megatron_core_mla_splits_the_rope_gradient(layout, errors):
    assert errors[layout]["rope rows"] > 0.1, errors[layout]
    assert max(errors[layout].values()) > 100 * BOUND


def test_negative_control_identity_kv_norm_hands_the_up_projection_a_slice(errors):
    assert errors["tp2_sp_identity_kv_norm"]["up-projection input contiguous"] == 0.0

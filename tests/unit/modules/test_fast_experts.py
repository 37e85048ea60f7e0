"""Grouped-GEMM experts and the sync-free dispatcher against megatron-core's (CPU).

``GroupedGemmExperts`` runs the same code on the CPU as on a GPU (``torch._grouped_mm`` has a
CPU kernel in torch 2.13); it must equal ``SequentialMLP`` on the same weights, forward and the
gradients of tokens, routing weights and every expert weight, with uneven expert loads
(an expert with no token included), for every activation branch of megatron's expert MLP. Its
parameters and checkpoint keys must be ``SequentialMLP``'s. ``SyncFreeAllToAllDispatcher`` must
permute and unpermute exactly as megatron's all-to-all dispatcher does at EP = 1, without a
host copy. Negative controls: wrong group offsets are caught; the reference dispatcher does copy
to the host; unsupported settings run the reference with a reason.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from megatron_hybrid.testing.overlap import rel_error

HIDDEN, FFN, EXPERTS = 32, 16, 4
COUNTS = [3, 0, 5, 2]  # tokens per expert, sorted by expert; expert 1 gets none


def _config(**overrides):
    from megatron_hybrid.testing.models import small_config

    sizes = dict(hidden_size=HIDDEN, num_attention_heads=4, moe_ffn_hidden_size=FFN,
                 num_moe_experts=EXPERTS, moe_router_topk=2)  # fmt: skip
    return small_config("E", **{**sizes, **overrides})


def _experts(pg, cls, config, seed=5):
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        model_parallel_cuda_manual_seed,
    )
    from megatron.core.transformer.mlp import MLPSubmodules

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return cls(config.num_moe_experts, config, submodules, pg_collection=pg)


def _inputs(dtype, counts=COUNTS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    tokens = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    probs = torch.rand(rows, generator=gen).to(dtype)
    return tokens, torch.tensor(counts), probs


def _run(module, tokens, counts, probs):
    module.zero_grad(set_to_none=True)
    x = tokens.detach().clone().requires_grad_()
    p = probs.detach().clone().requires_grad_()
    out, bias = module(x, counts, p)
    assert bias is None
    gen = torch.Generator().manual_seed(7)
    out.backward(torch.randn(out.shape, generator=gen).to(out.dtype))
    grads = {n: q.grad for n, q in module.named_parameters()}
    return {"out": out.detach(), "dx": x.grad, "dprobs": p.grad, **grads}


ACTIVATIONS = [
    pytest.param({}, id="gelu"),
    pytest.param({"gated_linear_unit": True, "activation_func": F.silu}, id="swiglu"),
    pytest.param(
        {"gated_linear_unit": True, "activation_func": F.silu, "bias_activation_fusion": True},
        id="swiglu-fused",
    ),
    pytest.param(
        {
            "gated_linear_unit": True,
            "activation_func": F.silu,
            "activation_func_clamp_value": 0.5,
            "glu_linear_offset": 1.0,
        },
        id="swiglu-clamp-offset",
    ),
    pytest.param(
        {"moe_router_topk": 1, "moe_router_pre_softmax": True, "moe_apply_probs_on_input": True},
        id="probs-on-input",
    ),
]


@pytest.mark.parametrize("overrides", ACTIVATIONS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])  # fmt: skip
def test_grouped_experts_match_sequential(pg, overrides, dtype, tol):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts

    config = _config(**overrides)
    fast, ref = _experts(pg, GroupedGemmExperts, config), _experts(pg, SequentialMLP, config)
    fast.to(dtype), ref.to(dtype)
    fast_run, ref_run = _run(fast, *_inputs(dtype)), _run(ref, *_inputs(dtype))
    assert fast.fast_path_reason is None
    assert set(fast_run) == set(ref_run)
    errors = {name: rel_error(fast_run[name], ref_run[name]) for name in ref_run
              if ref_run[name].abs().sum() > 0}  # fmt: skip
    assert max(errors.values()) < tol, errors
    # The expert that got no token gets an exactly zero weight gradient, as in the reference.
    for name in ("local_experts.1.linear_fc1.weight", "local_experts.1.linear_fc2.weight"):
        assert torch.count_nonzero(fast_run[name]) == 0


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_forward_only_first_call_keeps_the_grouped_path(pg, mode, monkeypatch):
    """The probe's verdict is kept for the process: a first call from a forward-only caller
    (``forward_logprobs`` runs under no_grad) must not turn the grouped path off. Control: the
    probe's backward fails in that mode where the probe does not turn autograd back on (the
    per-expert loop then ran every expert of the logprobs benchmark on GPUs)."""
    from megatron_hybrid.modules.fast import selection
    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts

    context = getattr(torch, mode)
    fast = _experts(pg, GroupedGemmExperts, _config())
    tokens, counts, probs = _inputs(torch.float32)
    selection._grouped_mm_probe.cache_clear()
    try:
        with context():
            fast(tokens, counts, probs)
        assert fast.fast_path_reason is None
        assert selection._grouped_mm_probe("cpu", torch.float32) is None
        selection._grouped_mm_probe.cache_clear()
        monkeypatch.setattr(selection, "probing_backward", contextlib.nullcontext)
        with context():
            assert "does not run on cpu" in selection._grouped_mm_probe("cpu", torch.float32)
    finally:
        selection._grouped_mm_probe.cache_clear()


def test_wrong_offsets_are_caught(pg, monkeypatch):
    """Negative control: group offsets one expert off move most rows to the wrong expert."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_hybrid.modules.fast import experts

    config = _config()
    fast, ref = _experts(pg, experts.GroupedGemmExperts, config), _experts(
        pg, SequentialMLP, config
    )
    right = experts.group_offsets
    monkeypatch.setattr(experts, "group_offsets", lambda c, d: right(c.roll(1), d))
    fast_run, ref_run = _run(fast, *_inputs(torch.float32)), _run(ref, *_inputs(torch.float32))
    assert rel_error(fast_run["out"], ref_run["out"]) > 0.1


def test_same_parameters_and_checkpoint_keys_as_sequential_mlp(pg):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts

    config = _config(gated_linear_unit=True, activation_func=F.silu)
    fast, ref = _experts(pg, GroupedGemmExperts, config), _experts(pg, SequentialMLP, config)
    fast_state, ref_state = fast.state_dict(), ref.state_dict()
    assert list(fast_state) == list(ref_state)
    for key, value in ref_state.items():  # tensors, and the linears' empty _extra_state
        assert (fast_state[key] is None and value is None) or torch.equal(fast_state[key], value)
    fast_sharded = fast.sharded_state_dict(prefix="mlp.experts.")
    ref_sharded = ref.sharded_state_dict(prefix="mlp.experts.")
    assert sorted(fast_sharded) == sorted(ref_sharded)
    for key, entry in ref_sharded.items():  # GLU weights are factories over sharded tensors
        other = fast_sharded[key]
        assert type(other) is type(entry) and other.key == entry.key
        fields = ("global_shape", "global_offset", "replica_id")
        assert all(getattr(other, f, None) == getattr(entry, f, None) for f in fields), key


@pytest.mark.parametrize("layout", ["built", "moved-apart"])
def test_expert_weights_are_built_into_one_storage(pg, layout, monkeypatch):
    """Each linear's expert weights are rows of one storage (separate parameters still), which
    the grouped GEMM multiplies without a stacking copy; weights moved apart afterwards (as
    megatron's DDP moves them) are stacked and give the same numbers."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_hybrid.modules.fast import grouped_linear as module
    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts
    from megatron_hybrid.modules.fast.grouped_add import stacked_view

    config = _config(gated_linear_unit=True, activation_func=F.silu)
    fast, ref = _experts(pg, GroupedGemmExperts, config), _experts(pg, SequentialMLP, config)
    params = list(fast.parameters())
    assert len(params) == len(list(ref.parameters())) == len({id(q) for q in params})
    if layout == "moved-apart":
        for q in params:
            q.data = q.data.clone()
    for name in ("linear_fc1", "linear_fc2"):
        weights = [getattr(e, name).weight for e in fast.local_experts]
        assert (stacked_view(weights) is not None) == (layout == "built")
    stacks = []
    stack = torch.stack
    monkeypatch.setattr(module.torch, "stack", lambda *a, **k: stacks.append(1) or stack(*a, **k))
    fast_run = _run(fast, *_inputs(torch.float32))
    monkeypatch.setattr(module.torch, "stack", stack)
    ref_run = _run(ref, *_inputs(torch.float32))
    # Forward and backward stack nothing when built; moved apart, each linear is stacked.
    assert len(stacks) == (0 if layout == "built" else 4), stacks
    for name, value in ref_run.items():
        assert rel_error(fast_run[name], value) < 1e-5, name


@pytest.mark.parametrize(
    "overrides, reason",
    [
        pytest.param({"add_bias_linear": True}, "expert biases", id="bias"),
        pytest.param({"moe_ffn_hidden_size": 10}, "not a multiple of 4", id="unaligned-width"),
        pytest.param(
            {"num_moe_experts": 1, "moe_router_topk": 1, "moe_router_pre_softmax": True},
            "one local expert",
            id="one-expert",
        ),
    ],
)
def test_unsupported_experts_run_the_reference(pg, overrides, reason):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_hybrid.modules.fast import selection
    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts

    config = _config(**overrides)
    experts = _experts(pg, GroupedGemmExperts, config)
    tokens = torch.zeros(4, HIDDEN)
    assert reason in selection.grouped_gemm_reason(experts, tokens)
    if overrides.get("add_bias_linear"):
        return  # megatron-core's SequentialMLP itself fails with biases (see HybridModel)
    ref = _experts(pg, SequentialMLP, config)
    counts = [4] if config.num_moe_experts == 1 else [1, 1, 1, 1]
    fast_run = _run(experts, *_inputs(torch.float32, counts))
    ref_run = _run(ref, *_inputs(torch.float32, counts))
    assert reason in experts.fast_path_reason
    assert torch.equal(fast_run["out"], ref_run["out"])


def test_wrapped_linears_run_the_reference(pg):
    """An adapter replacing an expert linear (as LoRA does) leaves the grouped path."""
    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts

    class Adapter(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.weight = base.weight

        def forward(self, x):
            out, bias = self.base(x)
            return out * 2, bias

    experts = _experts(pg, GroupedGemmExperts, _config())
    for expert in experts.local_experts:
        expert.linear_fc1 = Adapter(expert.linear_fc1)
    _run(experts, *_inputs(torch.float32))
    assert "Adapter" in experts.fast_path_reason


def _dispatchers(pg, config):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_hybrid.modules.fast.dispatch import SyncFreeAllToAllDispatcher

    args = (EXPERTS, list(range(EXPERTS)))
    return (SyncFreeAllToAllDispatcher(*args, config=config, pg_collection=pg),
            MoEAlltoAllTokenDispatcher(*args, config=config, pg_collection=pg))  # fmt: skip


def _dispatch_round_trip(dispatcher, hidden, probs, routing_map):
    tokens, permuted_probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    tokens, permuted_probs = dispatcher.token_dispatch(tokens, permuted_probs)
    tokens, counts, permuted_probs = dispatcher.dispatch_postprocess(tokens, permuted_probs)
    scaled = tokens * permuted_probs.unsqueeze(-1)
    out = dispatcher.combine_postprocess(
        dispatcher.token_combine(dispatcher.combine_preprocess(scaled))
    )
    return tokens, counts, permuted_probs, out


def test_sync_free_dispatcher_equals_megatrons_without_host_copies(pg, monkeypatch):
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    config = _config()
    fast, ref = _dispatchers(pg, config)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 1, HIDDEN, generator=gen)
    logits = torch.randn(6, EXPERTS, generator=gen)
    top = logits.topk(2, dim=-1).indices
    routing_map = torch.zeros(6, EXPERTS, dtype=torch.bool).scatter(1, top, True)
    probs = logits.softmax(-1) * routing_map
    expected = _dispatch_round_trip(ref, hidden, probs, routing_map)

    copies = []
    original = token_dispatcher.maybe_move_tensor_to_cpu
    monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu",
                        lambda *a, **k: copies.append(a) or original(*a, **k))  # fmt: skip
    got = _dispatch_round_trip(fast, hidden, probs, routing_map)
    assert fast.fast_path_reason is None
    assert copies == []  # no host copy (on a GPU: no wait for the GPU)
    assert torch.equal(got[1], routing_map.sum(0))  # counts stay a tensor of the device
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    # Negative control: megatron's dispatcher copies the counts to the host.
    _dispatch_round_trip(ref, hidden, probs, routing_map)
    assert copies


def test_dispatch_reasons():
    import types

    from megatron_hybrid.modules.fast.selection import sync_free_dispatch_reason

    def dispatcher(**fields):
        config = types.SimpleNamespace(moe_expert_capacity_factor=fields.pop("capacity", None),
                                       moe_router_padding_for_quantization=False)  # fmt: skip
        base = dict(ep_size=1, tp_size=1, drop_and_pad=False, config=config)
        return types.SimpleNamespace(**{**base, **fields})

    assert sync_free_dispatch_reason(dispatcher()) is None
    assert "split sizes on the host" in sync_free_dispatch_reason(dispatcher(ep_size=2))
    assert "token dropping" in sync_free_dispatch_reason(dispatcher(capacity=1.0))

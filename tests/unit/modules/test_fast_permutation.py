"""Token permutation with gathers against megatron-core's ``permute`` / ``unpermute`` (CPU).

The rows must come in megatron's order with megatron's permuted probabilities; the
unpermutation (a gather-and-sum) and both gradients must equal megatron's (float32, uneven
loads with experts that get no token), with no scatter or index add anywhere (megatron's use
them: the negative control). A token-to-row map that is off by one is caught.
"""

from __future__ import annotations

import pytest
import torch
from support.triton_interpreter import run_under_interpreter

from megatron_hybrid.testing.overlap import rel_error

TOKENS, EXPERTS, TOPK, HIDDEN = 20, 8, 3, 16
ATOMIC_OPS = ("aten::index_add_", "aten::scatter_add_", "aten::scatter_add", "aten::put_")


def _routing(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    logits[:, 2] = -1e4  # expert 2 never chosen
    top = logits.topk(TOPK, dim=-1).indices
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, top, True)
    probs = (logits.softmax(-1) * routing_map).requires_grad_()
    tokens = torch.randn(TOKENS, HIDDEN, generator=gen).requires_grad_()
    grad_rows = torch.randn(TOKENS * TOPK, HIDDEN, generator=gen)
    grad_out = torch.randn(TOKENS, HIDDEN, generator=gen)
    return routing_map, probs, tokens, grad_rows, grad_out


def _megatron(routing_map, probs, tokens, grad_rows, grad_out):
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    rows, permuted_probs, row_token, _, _ = permute(tokens, routing_map, probs=probs,
                                                    num_out_tokens=TOKENS * TOPK)  # fmt: skip
    detached = rows.detach().requires_grad_()
    out = unpermute(detached, row_token, restore_shape=tokens.shape, routing_map=routing_map)
    return _collect(rows, permuted_probs, row_token, detached, out, tokens, probs, grad_rows,
                    grad_out)  # fmt: skip


def _gathers(routing_map, probs, tokens, grad_rows, grad_out, mapping=None):
    from megatron_hybrid.modules.fast.permutation import (
        permutation_map,
        permute_probs,
        permute_tokens,
        unpermute_tokens,
    )

    mapping = mapping or permutation_map(routing_map, TOPK)
    rows = permute_tokens(tokens, mapping)
    permuted_probs = permute_probs(probs, mapping)
    detached = rows.detach().requires_grad_()
    out = unpermute_tokens(detached, mapping)
    return _collect(rows, permuted_probs, mapping.row_token, detached, out, tokens, probs,
                    grad_rows, grad_out)  # fmt: skip


def _collect(rows, permuted_probs, row_token, detached, out, tokens, probs, grad_rows, grad_out):
    tokens.grad = probs.grad = None
    torch.autograd.backward([rows, permuted_probs, out],
                            [grad_rows, torch.ones_like(permuted_probs), grad_out])  # fmt: skip
    return {"rows": rows.detach(), "probs": permuted_probs.detach(), "row_token": row_token,
            "out": out.detach(), "d_tokens": tokens.grad, "d_probs": probs.grad,
            "d_rows": detached.grad}  # fmt: skip


def test_gather_permutation_equals_megatrons(megatron_cpu):
    inputs = _routing()
    ours, theirs = _gathers(*inputs), _megatron(*inputs)
    for key in ("rows", "probs", "row_token", "d_probs", "d_rows"):
        assert torch.equal(ours[key], theirs[key]), key
    # Sums of k rows, in another order than megatron's scatter: float32 rounding apart.
    for key in ("out", "d_tokens"):
        assert rel_error(ours[key], theirs[key]) < 1e-6, key


def test_no_atomic_adds(megatron_cpu):
    from torch.profiler import ProfilerActivity, profile

    inputs = _routing()
    found = {}
    for name, run in (("gathers", _gathers), ("megatron", _megatron)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(*inputs)
        found[name] = {e.name for e in prof.events()} & set(ATOMIC_OPS)
    assert not found["gathers"]
    assert found["megatron"]  # negative control: megatron's permutation adds with atomics


def test_wrong_token_rows_are_caught(megatron_cpu):
    """Negative control: each token summing its neighbour's rows."""
    from megatron_hybrid.modules.fast.permutation import PermutationMap, permutation_map

    inputs = _routing()
    right = permutation_map(inputs[0], TOPK)
    wrong = PermutationMap(right.row_token, right.token_rows.roll(1, 0), right.flat_order)
    assert rel_error(_gathers(*inputs, mapping=wrong)["out"], _megatron(*inputs)["out"]) > 0.1


@pytest.mark.parametrize(
    "overrides, reason",
    [
        pytest.param({"moe_expert_capacity_factor": 1.0}, "token dropping", id="capacity"),
        pytest.param(
            {"moe_router_padding_for_quantization": True}, "router padding", id="router-padding"
        ),
        pytest.param({}, None, id="dropless"),
    ],
)
def test_gather_permutation_reason(overrides, reason):
    import types

    from megatron_hybrid.modules.fast.selection import gather_permutation_reason

    fields = dict(moe_permute_fusion=False, moe_expert_capacity_factor=None,
                  moe_router_padding_for_quantization=False)  # fmt: skip
    dispatcher = types.SimpleNamespace(
        config=types.SimpleNamespace(**{**fields, **overrides}), drop_and_pad=False
    )
    found = gather_permutation_reason(dispatcher)
    assert found is None if reason is None else reason in found


_UNDER_INTERPRETER = """
import torch
from megatron_hybrid.modules.fast.permutation import gather_sum

gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    rows = torch.randn(40, 1500, generator=gen).to(dtype)  # two column blocks, the last partial
    index = torch.randint(0, 40, (9, 5), generator=gen)
    total = torch.zeros(9, 1500)
    for j in range(5):  # float32, in index order, rounded once
        total += rows[index[:, j]].float()
    got = gather_sum(rows, index, use_triton=True)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, total), (got - total).abs().max()
    else:  # the interpreter rounds toward zero, CUDA to nearest (bitwise on a GPU)
        ulp = total.abs().clamp(min=1e-30).log2().floor().exp2() * 2.0**-7
        assert ((got.float() - total).abs() <= ulp).all()
    # Control: a row left out is seen.
    assert not torch.equal(gather_sum(rows, index[:, :4], use_triton=True), got)
    assert gather_sum(rows, index[:0], use_triton=True).shape == (0, 1500)
print("triton gather sum ok")
"""


@pytest.mark.slow
def test_triton_gather_sum_under_interpreter(tmp_path):
    """The Triton gather-and-sum (what CUDA runs for the unpermutation and the permutation's
    backward) on Triton's CPU interpreter: each token's rows summed in float32 in index order,
    bit for bit (bf16: rounded once, within one unit in the last place), a partial column block
    included; a left-out row is seen."""
    pytest.importorskip("triton.runtime.interpreter")
    run_under_interpreter(_UNDER_INTERPRETER, tmp_path, "triton gather sum ok")


@pytest.mark.parametrize(
    ("device", "shape", "dtype", "reason"),
    [
        ("cpu", (4, 8), torch.bfloat16, "not on CUDA"),
        ("meta", (4, 8), torch.bfloat16, "not on CUDA"),
    ],
    ids=["cpu", "meta"],
)
def test_gather_sum_reason_off_cuda(device, shape, dtype, reason):
    from megatron_hybrid.modules.fast.permutation import gather_sum_reason

    rows = torch.empty(shape, dtype=dtype, device=device)
    assert gather_sum_reason(rows, torch.zeros(2, 3, dtype=torch.long, device=device)) == reason

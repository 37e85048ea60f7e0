"""The grouped expert linear's gradients and their accumulation, against ``SequentialMLP`` (CPU).

``GroupedLinearFunction`` computes every expert's weight gradient in one grouped GEMM and adds
it itself: into one stacked ``.grad`` per linear under plain autograd, into megatron DDP's
``main_grad`` (with ``grad_added_to_main_grad`` and a placeholder for DDP's hooks) otherwise.
Over several micro-batches (an expert without tokens in some, one without tokens in all) the
output, the input gradient and every accumulated weight gradient must equal megatron-core's
``SequentialMLP`` under the same wrapper, without one add per expert. ``grouped_add_`` must add
into destinations anywhere in memory (megatron DDP's reversed, padded buffers) in one kernel;
its Triton kernel runs under Triton's CPU interpreter. Negative controls: a weight-gradient add
into the wrong expert, a profile of the reference (one add per expert), layouts that no view
covers.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from support.triton_interpreter import run_under_interpreter

from megatron_hybrid.testing.overlap import rel_error

HIDDEN, FFN, EXPERTS = 32, 16, 6
# Tokens per expert in three micro-batches: expert 1 never gets one, expert 4 only once.
COUNTS = ([3, 0, 5, 2, 0, 4], [1, 0, 2, 6, 3, 1], [4, 0, 1, 1, 0, 2])


def _config():
    from megatron_hybrid.testing.models import small_config

    return small_config("E", hidden_size=HIDDEN, num_attention_heads=4, moe_ffn_hidden_size=FFN,
                        num_moe_experts=EXPERTS, moe_router_topk=2, gated_linear_unit=True,
                        activation_func=F.silu)  # fmt: skip


def _experts(pg, cls, config, dtype):
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        model_parallel_cuda_manual_seed,
    )
    from megatron.core.transformer.mlp import MLPSubmodules

    torch.manual_seed(5)
    model_parallel_cuda_manual_seed(5)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return cls(config.num_moe_experts, config, submodules, pg_collection=pg).to(dtype)


def _micro_batch(module, counts, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    tokens = torch.randn(rows, HIDDEN, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(rows, generator=gen).to(dtype)
    out, _ = module(tokens, torch.tensor(counts), probs)
    out.backward(torch.randn(out.shape, generator=gen).to(dtype))
    return out.detach(), tokens.grad


def _wrap(module, config, pg, ddp: str | None):
    if ddp is None:
        return module
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_hybrid.modules.fast import mark_idle_grad_hooks

    kind, _, marked = ddp.partition("-")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=kind == "distopt",
        overlap_grad_reduce=kind == "overlap",
    )
    wrapped = DistributedDataParallel(config, ddp_config, module, pg_collection=pg)
    if marked:  # as train's wrap_model_chunks
        mark_idle_grad_hooks(wrapped)
    wrapped.zero_grad_buffer()
    return wrapped


def _train(pg, cls, dtype, ddp):
    """Two steps of three micro-batches each, as megatron's schedules run them (gradients
    zeroed in between: DDP's buffer, or ``.grad`` in place); the second step's outputs, input
    and weight grads (the first step's again: the same batches)."""
    import contextlib

    config = _config()
    module = _experts(pg, cls, config, dtype)
    model = _wrap(module, config, pg, ddp)
    for _ in range(2):
        if ddp is None:
            module.zero_grad(set_to_none=False)
        else:
            model.zero_grad_buffer()
        outputs = []
        for index, counts in enumerate(COUNTS):
            last = index == len(COUNTS) - 1
            sync = contextlib.nullcontext() if ddp is None or last else model.no_sync()
            with sync:
                outputs.append(_micro_batch(model, counts, seed=index, dtype=dtype))
        if ddp is not None:
            model.finish_grad_sync()
    grads = {n: (p.main_grad if ddp else p.grad) for n, p in module.named_parameters()}
    module.ready_counts = _ready_counts(model) if ddp and ddp.startswith("overlap") else None
    return module, outputs, grads


def _ready_counts(model) -> dict[str, int]:
    """How often DDP's hook registered each parameter's gradient as ready in the last
    micro-batch (what starts the overlapped reduction of its bucket)."""
    names = {p: n for n, p in model.module.named_parameters()}
    counts = {}
    for group in model.bucket_groups + model.expert_parallel_bucket_groups:
        counts.update({names[p]: c for p, c in group.per_param_grad_ready_counts.items()})
    return counts


DDP = [
    pytest.param(None, id="autograd"),
    pytest.param("ddp", id="ddp"),
    pytest.param("distopt", id="ddp-distopt"),
    pytest.param("overlap", id="ddp-overlap"),
    pytest.param("ddp-marked", id="ddp-idle-hooks"),
    pytest.param("distopt-marked", id="ddp-distopt-idle-hooks"),
    pytest.param("overlap-marked", id="ddp-overlap-marked"),
]


@pytest.mark.parametrize("ddp", DDP)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])  # fmt: skip
def test_accumulated_gradients_equal_sequential_mlp(pg, ddp, dtype, tol):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts
    from megatron_hybrid.modules.fast.grouped_add import stacked_view

    fast, fast_out, fast_grads = _train(pg, GroupedGemmExperts, dtype, ddp)
    _, ref_out, ref_grads = _train(pg, SequentialMLP, dtype, ddp)
    assert fast.fast_path_reason is None
    for (out, dx), (ref, ref_dx) in zip(fast_out, ref_out, strict=True):
        assert rel_error(out, ref) < tol and rel_error(dx, ref_dx) < tol
    assert fast_grads.keys() == ref_grads.keys()
    for name, grad in fast_grads.items():
        if "experts.1." in name:  # no token in any micro-batch: exactly zero, as the reference
            assert torch.count_nonzero(grad) == 0 and torch.count_nonzero(ref_grads[name]) == 0
        else:
            assert rel_error(grad, ref_grads[name]) < tol, name
    linears = [[e.linear_fc1.weight for e in fast.local_experts],
               [e.linear_fc2.weight for e in fast.local_experts]]  # fmt: skip
    if ddp is None:
        # Each linear's gradients are views of one stack: the next micro-batch adds once.
        for weights in linears:
            assert stacked_view([w.grad for w in weights]) is not None
    else:
        for weights in linears:
            assert all(w.grad is None and w.grad_added_to_main_grad for w in weights)
    if ddp and ddp.startswith("overlap"):
        # Every weight reported ready once, as with the reference (else no overlapped reduce).
        assert fast.ready_counts == dict.fromkeys(fast_grads, 1)


def _backward_adds(module, counts, dtype) -> int:
    """``add_`` operators in the backward of one more micro-batch into existing gradients."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _micro_batch(module, counts, seed=9, dtype=dtype)
    return sum(1 for e in prof.events() if e.name == "aten::add_")


def test_one_weight_gradient_add_per_linear(pg):
    """The second micro-batch adds its weight gradients with one kernel per linear; megatron's
    SequentialMLP (negative control) adds one per expert and linear."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts

    counts = [2, 1, 3, 1, 2, 1]
    adds = {}
    for cls in (GroupedGemmExperts, SequentialMLP):
        module = _experts(pg, cls, _config(), torch.float32)
        _micro_batch(module, counts, seed=1, dtype=torch.float32)
        adds[cls] = _backward_adds(module, counts, torch.float32)
    assert adds[GroupedGemmExperts] <= 2
    assert adds[SequentialMLP] >= 2 * EXPERTS


def test_wrong_expert_accumulation_is_caught(pg, monkeypatch):
    """Negative control: a weight-gradient add into the neighbouring expert's main_grad."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_hybrid.modules.fast import grouped_linear
    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts

    right = grouped_linear.grouped_add_
    monkeypatch.setattr(grouped_linear, "grouped_add_",
                        lambda dests, src: right(dests[1:] + dests[:1], src))  # fmt: skip
    _, _, fast = _train(pg, GroupedGemmExperts, torch.float32, "ddp")
    _, _, ref = _train(pg, SequentialMLP, torch.float32, "ddp")
    assert max(rel_error(fast[n], ref[n]) for n in ref if "experts.1." not in n) > 0.1


def test_missing_placeholders_are_caught(pg, monkeypatch):
    """Negative control: gradients added to main_grad without a placeholder for DDP's hooks
    (which then see no gradient) are refused under overlap_grad_reduce."""
    from megatron_hybrid.modules.fast import grouped_linear
    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts

    right = grouped_linear._into_main_grads
    monkeypatch.setattr(grouped_linear, "_into_main_grads",
                        lambda w, m, g: [None for _ in right(w, m, g)])  # fmt: skip
    with pytest.raises(AssertionError, match="param.grad being None"):
        _train(pg, GroupedGemmExperts, torch.float32, "overlap")


@pytest.mark.parametrize(
    ("ddp", "delivered"),
    [("ddp-marked", 0), ("ddp", 2 * EXPERTS), ("overlap-marked", 2 * EXPERTS)],
    ids=["idle-hooks", "unmarked", "overlap"],
)
def test_idle_hooks_get_no_gradient(pg, ddp, delivered):
    """Marked chunks without overlap_grad_reduce: no gradient reaches autograd's accumulator
    (or DDP's hook) for any expert weight; unmarked, or overlapping the reduction (whose hook
    counts each gradient), one placeholder per weight does (the controls)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts

    config = _config()
    model = _wrap(_experts(pg, GroupedGemmExperts, config, torch.float32), config, pg, ddp)
    _micro_batch(model, COUNTS[0], seed=1, dtype=torch.float32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _micro_batch(model, COUNTS[0], seed=2, dtype=torch.float32)
    accumulated = sum(1 for e in prof.events() if e.name == "torch::autograd::AccumulateGrad")
    assert accumulated - 1 == delivered  # the tokens (a leaf) get theirs


@pytest.mark.parametrize(
    ("ddp", "graph_inputs"),
    [("ddp-marked", 0), ("ddp", 2 * EXPERTS), ("overlap-marked", 2 * EXPERTS)],
    ids=["idle-hooks", "unmarked", "overlap"],
)
def test_graph_inputs_are_the_parameters_autograd_reaches(pg, ddp, graph_inputs):
    """A CUDA graph of the experts takes as extra inputs only the weights autograd delivers
    gradients to (``schedule/graph_capture.py``): none where DDP's hooks are idle (their
    gradients go into ``main_grad`` inside the backward), every weight otherwise (the
    controls)."""
    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts
    from megatron_hybrid.schedule.graph_capture import reached_parameters

    config = _config()
    module = _experts(pg, GroupedGemmExperts, config, torch.float32)
    model = _wrap(module, config, pg, ddp)
    tokens = torch.randn(sum(COUNTS[0]), HIDDEN).requires_grad_()
    args = (tokens, torch.tensor(COUNTS[0]), torch.rand(tokens.shape[0]))
    reached = reached_parameters(model.module, args)
    weights = {id(p) for p in module.parameters()}
    assert len(reached) == graph_inputs and all(id(p) in weights for p in reached)
    if graph_inputs:  # in parameter order
        assert [id(p) for p in reached] == [id(p) for p in module.parameters()]
    assert all(float(p.main_grad.abs().sum()) == 0 for p in module.parameters())


def test_frozen_weights_get_no_weight_gradient_gemm(pg):
    """Frozen expert weights (LoRA): the input gradient only, one grouped GEMM per linear."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_hybrid.modules.fast.experts import GroupedGemmExperts

    module = _experts(pg, GroupedGemmExperts, _config(), torch.float32)
    module.requires_grad_(False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, dx = _micro_batch(module, COUNTS[0], seed=1, dtype=torch.float32)
    grouped = [e for e in prof.events() if e.name == "aten::_grouped_mm"]
    assert len(grouped) == 4  # forward fc1, fc2; backward: their input gradients
    assert dx is not None and all(p.grad is None for p in module.parameters())


def _saved_stacks(weights, rows=12):
    """``[E, out, in]`` tensors the grouped linear saves for its backward, and the backward's
    input and weight gradients."""
    from megatron_hybrid.modules.fast.grouped_linear import grouped_linear

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randn(rows, weights[0].shape[1], generator=gen).requires_grad_()
    offsets = torch.tensor([3, 3, 8, rows], dtype=torch.int32)
    saved = []

    def pack(tensor):
        if tensor.dim() == 3:
            saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = grouped_linear(tokens, offsets, weights)
    out.backward(torch.randn(out.shape, generator=gen))
    return saved, tokens.grad, [w.grad for w in weights]


def test_weight_copies_are_not_kept_for_the_backward():
    """Separate expert weights: the stack (a copy) is made again in the backward, not saved
    (it would hold a second copy of every expert weight until then); evenly spaced weights
    (negative control of the detection): the view is saved. Gradients equal either way."""
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(4, 8, 12, generator=gen)
    separate = [w.clone().requires_grad_() for w in stack]
    spaced = stack.clone().requires_grad_()
    views = list(spaced.unbind(0))
    copies, dx, dw = _saved_stacks(separate)
    saved, view_dx, _ = _saved_stacks(views)
    assert copies == []
    assert len(saved) == 1 and saved[0].data_ptr() == spaced.data_ptr()
    assert torch.allclose(dx, view_dx) and torch.allclose(torch.stack(dw), spaced.grad)


def test_weights_changed_before_the_backward_are_refused():
    from megatron_hybrid.modules.fast.grouped_linear import grouped_linear

    weights = [torch.randn(8, 12).requires_grad_() for _ in range(4)]
    tokens = torch.randn(12, 12, requires_grad=True)
    out = grouped_linear(tokens, torch.tensor([3, 3, 8, 12], dtype=torch.int32), weights)
    with torch.no_grad():
        weights[2].mul_(2)
    with pytest.raises(RuntimeError, match="expert 2.s weight .* modified in place"):
        out.sum().backward()


@pytest.mark.parametrize("layout", ["apart", "one-storage"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "enable_grad"])
def test_forward_only_skips_the_autograd_function(mode, layout, monkeypatch):
    """Without autograd the grouped GEMM runs alone and equals the per-expert products; with it
    (control) the autograd function runs, so the check would see the shortcut taken there.
    Weights apart are stacked; weights in one storage are multiplied where they lie."""
    from megatron_hybrid.modules.fast import grouped_linear as module

    gen = torch.Generator().manual_seed(5)
    if layout == "apart":
        weights = [torch.randn(8, 12, generator=gen).requires_grad_() for _ in range(4)]
    else:
        stack = torch.randn(4, 8, 12, generator=gen)
        weights = [torch.nn.Parameter(stack[e]) for e in range(4)]
        assert module.stacked_view(weights) is not None
    monkeypatch.setattr(module.torch, "stack", _refuse_stack if layout != "apart" else torch.stack)
    tokens = torch.randn(12, 12, generator=gen)
    counts = [3, 0, 5, 4]
    offsets = torch.tensor(counts).cumsum(0, dtype=torch.int32)
    calls = []
    apply = module.GroupedLinearFunction.apply
    monkeypatch.setattr(module.GroupedLinearFunction, "apply",
                        lambda *args: calls.append(len(args)) or apply(*args))  # fmt: skip
    with getattr(torch, mode)():
        out = module.grouped_linear(tokens, offsets, weights)
    assert calls == ([] if mode != "enable_grad" else [3 + len(weights)])
    assert out.requires_grad == (mode == "enable_grad")
    with torch.no_grad():
        torch.testing.assert_close(out, _reference_linear(tokens, counts, weights))


def _refuse_stack(*args, **kwargs):
    raise AssertionError("weights in one storage were copied into a stack")


def _reference_linear(tokens, counts, weights):
    parts = torch.split(tokens, counts)
    return torch.cat([part @ w.t() for part, w in zip(parts, weights, strict=True)])


def _two_passes(second: str, impl: str):
    """One ``backward()`` (gradients in ``.grad``: for the grouped linear a stack of views),
    then a second pass; ``(.grad after the first, .grad after the second, what the second
    returned)``."""
    from megatron_hybrid.modules.fast.grouped_linear import grouped_linear

    gen = torch.Generator().manual_seed(4)
    weights = [torch.randn(8, 12, generator=gen).requires_grad_() for _ in range(4)]
    tokens = torch.randn(12, 12, generator=gen).requires_grad_()
    counts = [3, 0, 5, 4]
    offsets = torch.tensor(counts).cumsum(0, dtype=torch.int32)

    def run():
        if impl == "reference":
            return _reference_linear(tokens, counts, weights)
        return grouped_linear(tokens, offsets, weights)

    run().square().sum().backward()
    first = [w.grad.clone() for w in weights]
    loss = run().sum()
    returned = []
    if second == "autograd_grad":
        returned = torch.autograd.grad(loss, weights)
    elif second == "backward_inputs":
        loss.backward(inputs=[tokens])
    else:
        for weight in weights:
            weight.register_hook(lambda grad: 2 * grad)
        loss.backward()
    return first, [w.grad.clone() for w in weights], list(returned)


@pytest.mark.parametrize("second", ["autograd_grad", "backward_inputs", "hooked"])
def test_passes_that_do_not_accumulate_leave_grad_alone(second):
    """``torch.autograd.grad`` and ``backward(inputs=[tokens])`` after a ``backward()`` leave
    ``.grad`` as it was (the first returns this pass's gradients); a gradient hook on each
    weight sees this pass's gradient, not the running sum: all as the per-expert reference."""
    fast = _two_passes(second, "grouped")
    ref = _two_passes(second, "reference")
    for got, want in zip(fast, ref, strict=True):
        assert len(got) == len(want)
        for x, y in zip(got, want, strict=True):
            assert torch.allclose(x, y, atol=1e-5), second
    if second != "hooked":
        assert all(torch.equal(x, y) for x, y in zip(fast[0], fast[1], strict=True))


def test_stacked_view_only_where_one_view_covers_the_tensors():
    from megatron_hybrid.modules.fast.grouped_add import stacked_view

    stack = torch.arange(60.0).view(3, 4, 5)
    view = stacked_view(list(stack.unbind(0)))
    assert view is not None and view.data_ptr() == stack.data_ptr() and torch.equal(view, stack)
    spaced = torch.zeros(100)
    parts = [spaced[i * 30 : i * 30 + 20].view(4, 5) for i in range(3)]
    assert stacked_view(parts).stride() == (30, 5, 1)
    # Negative controls: reversed order, uneven gaps, separate storages, overlap, a transpose.
    assert stacked_view(parts[::-1]) is None
    assert stacked_view([spaced[0:20].view(4, 5), spaced[30:50].view(4, 5),
                         spaced[70:90].view(4, 5)]) is None  # fmt: skip
    assert stacked_view([torch.zeros(4, 5) for _ in range(3)]) is None
    assert stacked_view([spaced[i * 10 : i * 10 + 20].view(4, 5) for i in range(3)]) is None
    assert stacked_view([p.t() for p in parts]) is None


def _scattered(dtype=torch.float32):
    """Destinations as megatron DDP places them: reversed, unevenly spaced, one buffer."""
    buffer = torch.zeros(2000, dtype=dtype)
    starts = [1500, 1200, 960, 600]  # a gap of 60 elements between two of them
    dests = [buffer[s : s + 160].view(10, 16) for s in starts]
    gen = torch.Generator().manual_seed(0)
    for dest in dests:
        dest.copy_(torch.randn(10, 16, generator=gen))
    return buffer, starts, dests


def test_offset_tables_are_per_dtype():
    """The same addresses read as another dtype are other element offsets (a cached table of
    float32 offsets must not serve bfloat16 destinations)."""
    from megatron_hybrid.modules.fast.grouped_add import destination_offsets

    raw = torch.zeros(4000, dtype=torch.uint8)
    starts = [3000, 2400, 800]  # bytes, a multiple of 4
    wide = [raw[s : s + 64].view(torch.float32) for s in starts]
    narrow = [raw[s : s + 64].view(torch.bfloat16) for s in starts]
    assert [d.data_ptr() for d in wide] == [d.data_ptr() for d in narrow]
    assert destination_offsets(wide, False).tolist() == [0, -150, -550]
    assert destination_offsets(narrow, False).tolist() == [0, -300, -1100]


def test_grouped_add_anywhere_in_memory():
    from megatron_hybrid.modules.fast.grouped_add import grouped_add_

    buffer, starts, dests = _scattered()
    before, outside = buffer.clone(), torch.ones_like(buffer, dtype=torch.bool)
    for start in starts:
        outside[start : start + 160] = False
    source = torch.randn(4, 10, 16).to(torch.bfloat16)
    grouped_add_(dests, source)
    for dest, start, addend in zip(dests, starts, source, strict=True):
        assert torch.equal(dest, before[start : start + 160].view(10, 16) + addend.float())
    assert torch.equal(buffer[outside], before[outside])


_UNDER_INTERPRETER = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_fast_grouped_linear import _scattered
from megatron_hybrid.modules.fast import grouped_add

buffer, starts, dests = _scattered()
before = buffer.clone()
source = torch.randn(4, 10, 16).to(torch.bfloat16)
grouped_add.grouped_add_(dests, source, use_triton=True)
assert len(grouped_add._OFFSETS) == 1, "the Triton kernel did not run"
expected = before.clone()
for start, addend in zip(starts, source):
    expected[start : start + 160] += addend.float().view(-1)
assert torch.equal(buffer, expected), (buffer - expected).abs().max()
print("triton grouped add ok")
"""


@pytest.mark.slow
def test_triton_grouped_add_under_interpreter(tmp_path):
    """The Triton kernel (the path CUDA takes for float32 main_grad), on Triton's CPU
    interpreter: every destination gets its addend, nothing else changes."""
    pytest.importorskip("triton.runtime.interpreter")
    run_under_interpreter(
        _UNDER_INTERPRETER.format(tests=os.path.dirname(__file__)),
        tmp_path,
        "triton grouped add ok",
    )


_WGRAD_UNDER_INTERPRETER = """
import sys, torch
sys.path.insert(0, {tests!r})
from megatron_hybrid.modules.fast.grouped_wgrad import grouped_wgrad_into_main_grads

# Rows per expert: several K blocks with a partial one, none, a partial block only, three.
counts = [70, 0, 5, 131]
out_f, in_f = 150, 130  # partial tiles in both directions
gen = torch.Generator().manual_seed(0)
rows = sum(counts)
# float16: the interpreter multiplies bfloat16 tiles as their integer bits (numpy has no
# bfloat16); the kernel is the same for both, bfloat16 runs on a GPU (test_fast_path_gpu.py).
grad = torch.randn(rows, out_f, generator=gen).half()
tokens = torch.randn(rows, in_f, generator=gen).half()
ends = torch.tensor(counts).cumsum(0).int()
# Destinations anywhere in one buffer, in reverse order, as megatron DDP lays them out.
buffer = torch.randn(4 * out_f * in_f + 999, generator=gen)
starts = [3 * out_f * in_f + 999, 2 * out_f * in_f + 500, out_f * in_f + 7, 0]
dests = [buffer[s : s + out_f * in_f].view(out_f, in_f) for s in starts]
before = buffer.clone()


def reference(ends_):
    out, start = [], 0
    for dest, start_, end in zip(dests, [0, *ends_[:-1].tolist()], ends_.tolist()):
        g, x = grad[start_:end].double(), tokens[start_:end].double()
        old = before[starts[len(out)] : starts[len(out)] + out_f * in_f].view(out_f, in_f)
        bound = (end - start_ + 1) * 2.0**-24 * (old.double().abs() + g.abs().t() @ x.abs())
        out.append((old.double() + g.t() @ x, bound))
    return out


assert grouped_wgrad_into_main_grads(grad, tokens, ends, dests)
inside = torch.zeros_like(buffer, dtype=torch.bool)
for s in starts:
    inside[s : s + out_f * in_f] = True
assert torch.equal(buffer[~inside], before[~inside]), "written outside the destinations"
assert torch.equal(dests[1], before[starts[1] : starts[1] + out_f * in_f].view(out_f, in_f))
ratios = [float(((d.double() - e).abs() / b.clamp(min=1e-300)).max())
          for d, (e, b) in zip(dests, reference(ends))]
assert max(ratios) <= 1, ratios
# Control: the rows of experts 0 and 2 shifted by one.
shifted = ends.clone()
shifted[0] -= 1
control = [float(((d.double() - e).abs() / b.clamp(min=1e-300)).max())
           for d, (e, b) in zip(dests, reference(shifted))]
assert control[0] > 1, control
print("triton grouped wgrad ok", ratios, control)
"""


@pytest.mark.slow
def test_triton_grouped_wgrad_under_interpreter(tmp_path):
    """The one-kernel weight-gradient GEMM into float32 ``main_grad`` (what CUDA runs for the
    grouped experts in megatron DDP) on Triton's CPU interpreter: every expert's destination,
    anywhere in one buffer, within float32 accumulation's error bound of the float64 products
    plus its old value; an expert without rows and the memory around the destinations
    untouched. Control: the bound fails against experts' rows shifted by one."""
    pytest.importorskip("triton.runtime.interpreter")
    run_under_interpreter(
        _WGRAD_UNDER_INTERPRETER.format(tests=os.path.dirname(__file__)),
        tmp_path,
        "triton grouped wgrad ok",
    )

"""``gradient_accumulation_fusion`` with the package's weight-gradient kernels on a GPU.

    torchrun --nproc_per_node 1 -m pytest -q -s tests/functional/test_wgrad_fusion_gpu.py

``train`` turns it on for its local linear layers on GPUs (``training/fusions.py``): each adds
``grad_output^T @ input`` into its weight's float32 ``main_grad`` with one ``torch.addmm``
(bfloat16 operands, a float32 output written in place; ``modules/fast/wgrad.py``). Checked here:
the kernel against float64 at ``benchmarks/mfu.py``'s expert-free linear sizes, in place; and a
bf16 model in megatron's DDP (reference modules, deterministic on the GPU, tied output weight)
whose every ``main_grad`` after two micro-batches is the unfused path's within the two paths'
roundings (``support/wgrad_check.py``), parameters outside the linears bit for bit; and the
same chunk with its pieces CUDA-graphed (``--hybrid-cuda-graphs``) bit for bit the eager one.
Controls: the kernel result without the old ``main_grad`` added, and kernels that overwrite
instead of adding (eager, and captured in the graphs).
"""

from __future__ import annotations

import pytest
import torch
from conftest import one_process_groups
from support.wgrad_check import (
    U32,
    capture_products,
    keep_megatron_linears_module,
    main_grad_ratios,
)

PATTERN = "[*-]{2}"
BATCH, SEQ = 2, 64


@pytest.fixture
def pg(world):
    yield from one_process_groups(
        world, "the float32-output GEMM runs on CUDA",
        "one process: the bound follows one rank's whole micro-batches",
    )  # fmt: skip


@pytest.fixture
def kernels(monkeypatch):
    from megatron_hybrid.modules.fast import wgrad

    keep_megatron_linears_module(monkeypatch)
    wgrad.install_wgrad_kernels()
    return wgrad


@pytest.mark.parametrize("shape", [(4096, 2048, 6144), (4096, 2048, 32768)], ids=["qkv", "vocab"])
def test_kernel_adds_in_place_within_float32_rounding(pg, kernels, shape):
    tokens, inner, outer = shape
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, inner, device="cuda", generator=generator).bfloat16()
    g = torch.randn(tokens, outer, device="cuda", generator=generator).bfloat16()
    main = torch.randn(outer, inner, device="cuda", generator=generator)
    before, address = main.clone(), main.data_ptr()
    kernels.WGRAD_KERNELS.wgrad_gemm_accum_fp32(x, g, main)
    torch.cuda.synchronize()
    assert main.data_ptr() == address and main.dtype == torch.float32
    products = g.double().t() @ x.double()
    bound = (tokens + 1) * U32 * (before.double().abs() + g.double().abs().t() @ x.double().abs())
    ratio = float(((main.double() - before.double() - products).abs() / bound).max())
    # Control: the same result without the old main_grad added is far outside the bound.
    control = float(((main.double() - products).abs() / bound).max())
    print(f"\n{shape}: error / bound {ratio:.3g}; control (no accumulation) {control:.3g}")
    assert ratio <= 1 < control


def _chunk(pg, *, fused: bool, like=None, graphs: bool = False, pattern: str = PATTERN,
           impl: str = "reference"):  # fmt: skip
    """A chunk in megatron's DDP; ``like``'s weights where given (megatron initialises on the
    GPU with its own RNG tracker, so a seed alone does not repeat them); ``graphs``: its pieces
    graphed as ``train --hybrid-cuda-graphs`` builds them (before DDP wraps the model)."""
    from megatron_hybrid.modules import hybrid_stack_spec
    from megatron_hybrid.training.config import config_from_flags
    from megatron_hybrid.training.loop import build_model_chunks

    flags = ("--hidden-size", "256", "--num-attention-heads", "4", "--swiglu", "--bf16",
             "--disable-bias-linear", "--ffn-hidden-size", "512",
             "--vocab-size", "512")  # fmt: skip
    if "E" in pattern:
        flags += ("--num-experts", "16", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "128")
    config = config_from_flags(pattern, *flags, gradient_accumulation_fusion=fused)
    spec = hybrid_stack_spec("local", config=config, local_impl=impl)
    torch.manual_seed(7)
    (chunk,) = build_model_chunks(config, pattern, pg, backend="local", vocab_size=512,
                                  max_sequence_length=SEQ, stack_spec=spec,
                                  hybrid_cuda_graphs=graphs)  # fmt: skip
    if like is not None:
        chunk.module.load_state_dict(like.module.state_dict())
    return chunk


def _steps(chunk) -> dict[str, torch.Tensor]:
    chunk.zero_grad_buffer()
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 512, (BATCH, SEQ), generator=generator).cuda()
        positions = torch.arange(SEQ).expand(BATCH, SEQ).cuda()
        logits = chunk(input_ids=tokens, position_ids=positions, attention_mask=None)
        weights = torch.randn(logits.shape, generator=generator).cuda()
        (logits.float() * weights).sum().backward()
    chunk.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in chunk.module.named_parameters()}


def _overwriting(add):
    """``add`` into a list of destinations (its first argument or its last), zeroing them
    first: a deliberate bug, overwrite instead of accumulate."""

    def overwrite(*args, **kwargs):
        destinations = args[0] if isinstance(args[0], list | tuple) else args[-1]
        for dest in destinations:
            dest.zero_()
        return add(*args, **kwargs)

    return overwrite


def _overwrite(total_input, grad_output, main_grad):
    torch.mm(grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)


@pytest.mark.parametrize("control", [False, True], ids=["fused", "control-overwrite"])
def test_bf16_model_main_grads_are_the_unfused_ones(pg, kernels, monkeypatch, control):
    if control:
        monkeypatch.setattr(kernels.WGRAD_KERNELS, "wgrad_gemm_accum_fp32", _overwrite)
    first = _chunk(pg, fused=False)
    chunk = _chunk(pg, fused=True, like=first)
    unfused = _steps(first)
    captured = capture_products(chunk.module)
    fused = _steps(chunk)
    named = dict(chunk.module.named_parameters())
    assert captured and all(named[n].grad_added_to_main_grad
                            for n in named if id(named[n]) in captured)  # fmt: skip
    ratios = main_grad_ratios(fused, unfused, named, captured, BATCH * SEQ, rounded_to_bf16=True)
    worst = max(ratios, key=ratios.get)
    print(f"\nworst main_grad error / bound: {ratios[worst]:.3g} ({worst})")
    assert (ratios[worst] <= 1) is not control


@pytest.mark.parametrize("control", [False, True], ids=["graphed", "control-overwrite-in-graph"])
def test_graphed_pieces_add_what_eager_ones_add(pg, kernels, monkeypatch, control):
    """``train --hybrid-cuda-graphs``: a captured backward holds the fused add into
    ``main_grad`` (replayed, its Python flag set again by the graphs, ``schedule/graphs.py``):
    two steps of two micro-batches give the eager chunk's ``main_grad`` bit for bit. Control: the
    graphs capture kernels that overwrite instead of adding."""
    eager = _chunk(pg, fused=True)
    graphed = _chunk(pg, fused=True, like=eager, graphs=True)
    report = graphed.module.module.hybrid_cuda_graphs
    expected = [_steps(eager) for _ in range(2)]
    if control:
        monkeypatch.setattr(kernels.WGRAD_KERNELS, "wgrad_gemm_accum_fp32", _overwrite)
    got = [_steps(graphed) for _ in range(2)]
    assert report.graphed and all(
        g.disabled is None and g.captures >= 1 and g.replays >= 3 and not g.eager_calls
        for g in report.graphed.values()
    ), report.summary()
    differ = sorted({n for a, b in zip(got, expected, strict=True) for n in a
                     if not torch.equal(a[n], b[n])})  # fmt: skip
    print(f"\ngraphed pieces: {len(report.graphed)}; main_grads that differ: {differ[:3]}")
    assert bool(differ) is control


@pytest.mark.parametrize("control", [False, True], ids=["graphed", "control-overwrite-in-graph"])
def test_graphed_experts_take_no_weight_inputs(pg, kernels, monkeypatch, control):
    """``train --hybrid-cuda-graphs`` on the fast path (``[*E]{2}``: grouped-GEMM experts,
    sync-free dispatch, each MoE layer one graph): DDP's hooks are idle, so of the layer's
    weights only the router's is a graph input (the experts' backward adds into ``main_grad``
    inside the graph; as inputs each replay ran autograd's accumulator and DDP's hook for every
    expert weight), and every ``main_grad`` after two steps of two micro-batches is the eager
    chunk's within the eager chunk's own run-to-run difference (FlashAttention's backward adds
    with atomics). Control: the captured grouped add overwrites instead of adding."""
    from megatron_hybrid.modules.fast import grouped_linear

    pattern = "[*E]{2}"
    eager = _chunk(pg, fused=True, pattern=pattern, impl="fast")
    graphed = _chunk(pg, fused=True, like=eager, graphs=True, pattern=pattern, impl="fast")
    report = graphed.module.module.hybrid_cuda_graphs
    expected, again = _steps(eager), _steps(eager)
    if control:  # both ways into main_grad: the one-kernel GEMM, else the grouped add
        for module, name in ((grouped_linear, "grouped_wgrad_into_main_grads"),
                             (grouped_linear, "grouped_add_")):  # fmt: skip
            monkeypatch.setattr(module, name, _overwriting(getattr(module, name)))
    got = [_steps(graphed) for _ in range(2)][-1]
    # The fast path at EP 1 graphs each MoE layer whole (modules/layer_types/moe.py).
    layers = {n: g for n, g in report.graphed.items() if n.endswith(".mlp")}
    assert len(layers) == 2 and all(
        g.disabled is None and g.captures == 1 and g.replays == 4 and not g.eager_calls
        for g in report.graphed.values()
    ), report.summary()
    inputs = [
        [n.rsplit(".", 2)[-2] for n, p in g.module.named_parameters()
         if any(p is q for q in instance.graphed.graph_params)]
        for g in layers.values() for pool in g.instances.values() for instance in pool
    ]  # fmt: skip
    beyond = {}
    for name, value in got.items():
        noise = float((again[name] - expected[name]).abs().max())
        diff = float((value - expected[name]).abs().max())
        if diff > 2 * noise:
            beyond[name] = (diff, noise)
    print(f"\nMoE layers' graph weight inputs: {inputs}; main_grads beyond eager noise: "
          f"{sorted(beyond)[:3]} of {len(got)}")  # fmt: skip
    assert inputs == [["router"], ["router"]]
    assert bool(beyond) is control


def test_pieces_graphed_after_ddp_wrapped_say_how_to_order_it(pg):
    """The control of the test above: pieces graphed after megatron's DDP made its gradient
    accumulators on the default stream fail to capture, run eager, and say to graph first."""
    from megatron_hybrid.schedule import enable_cuda_graphs

    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    chunk = _chunk(pg, fused=False)
    report = enable_cuda_graphs(chunk)
    grads = [_steps(chunk) for _ in range(2)]
    reasons = {name: g.disabled for name, g in report.graphed.items()}
    print(f"\n{report.summary()}")
    assert reasons and all(r is not None and "graph them first" in r for r in reasons.values())
    assert all(torch.isfinite(g).all() for step in grads for g in step.values())

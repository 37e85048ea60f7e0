"""CUDA graphs of the layers' compute pieces, checked on the CPU with a stand-in capture.

The stand-in records which piece it is asked to capture and returns the piece itself (eager), so
everything around the capture runs as on a GPU: the pieces named by the layer-type table get
their forward replaced, each call is split into tensor inputs and a signature, graph instances
are taken and given back by backward, outputs are put back into their structure. The tests
check which modules go through the graphs (token mixers, dense MLPs, routers) and which never do
(routed experts, dispatch), and that losses and gradients stay bitwise those of the ungraphed
model, in the plain schedule and in the EP-overlap plan. Real capture and replay are checked on
a GPU by ``tests/functional/test_cuda_graphs_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from support.mla import mla_config
from support.packing import pack_apart

from megatron_hybrid.testing.models import build_hybrid, model_inputs, small_config


class StandIn:
    """A capture function that records its pieces and returns them uncaptured.

    Args:
        perturb: scale the first output by this factor (a deliberate bug for the negative
            control).
    """

    def __init__(self, perturb: float | None = None):
        self.captured: list[int] = []
        self.replayed: list[int] = []
        self.perturb = perturb

    def __call__(self, piece, sample_args):
        target = id(piece.target)
        self.captured.append(target)

        def replay(*tensors):
            self.replayed.append(target)
            outputs = piece(*tensors)
            if self.perturb is None:
                return outputs
            return (outputs[0] * self.perturb, *outputs[1:])

        return replay

    def names(self, model, ids: list[int]) -> set[str]:
        """Module names of ``ids`` in ``model``."""
        by_id = {id(m): n for n, m in model.named_modules()}
        return {by_id[i] for i in ids}


# Expected by hand, not read from the table: the table is what is tested.
CASES = [
    pytest.param(
        "[*E]{2}",
        {f"decoder.layers.{i}.layers.{j}" for i in (0, 1)
         for j in ("0.self_attention", "1.mlp.router")},
        id="attention-moe-x2",
    ),
    pytest.param(
        "[GE]",
        {"decoder.layers.0.layers.0.self_attention", "decoder.layers.0.layers.1.mlp.router"},
        id="gated-delta-net-moe",
    ),
    pytest.param(
        "[*-]",
        {"decoder.layers.0.layers.0.self_attention", "decoder.layers.0.layers.1.mlp"},
        id="attention-dense",
    ),
    pytest.param("M", {"decoder.layers.0.mixer"}, id="mamba"),
]  # fmt: skip


def _needs(pattern: str) -> None:
    if "G" in pattern:
        pytest.importorskip("fla")


def _build(pattern, pg, like=None, local_impl="reference", **changes):
    """A small model (MLA's config for ``+``); ``like``: a model whose weights it takes
    (GatedDeltaNet's initialisation draws from an RNG that the seed does not reset)."""
    torch.manual_seed(3)
    config = small_config(pattern, **changes)
    config = mla_config(config) if "+" in pattern else config
    model = build_hybrid(config, pattern, pg, local_impl=local_impl)
    if like is not None:
        model.load_state_dict(like.state_dict())
    return model


def _step(model, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**model_inputs(seed=seed)).float().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(actual, reference) -> None:
    (loss, grads), (ref_loss, ref_grads) = actual, reference
    assert torch.equal(loss, ref_loss), f"loss {loss.item()} != {ref_loss.item()}"
    assert grads.keys() == ref_grads.keys()
    differing = [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
    assert not differing, f"gradients differ: {differing}"


@pytest.mark.parametrize("pattern, expected", CASES)
def test_plain_schedule_graphs_the_table_pieces_bitwise(pg, pattern, expected):
    from megatron_hybrid.schedule import enable_cuda_graphs

    _needs(pattern)
    reference = _build(pattern, pg)
    model = _build(pattern, pg, like=reference)
    stand_in = StandIn()
    report = enable_cuda_graphs(model, capture=stand_in)
    assert set(report.graphed) == expected

    for seed in (0, 1):
        _assert_same(_step(model, seed), _step(reference, seed))
    # Every graphed piece replays, once per step; the instance captured in the first step is
    # given back by its backward, so the second step captures nothing new.
    assert stand_in.names(model, stand_in.replayed) == expected
    assert sorted(stand_in.captured) == sorted(set(stand_in.captured))
    assert len(stand_in.replayed) == 2 * len(expected)
    assert all(g.replays == 2 and g.captures == 1 for g in report.graphed.values())


def test_moe_dispatch_and_experts_stay_eager_with_reasons(pg):
    from megatron_hybrid.schedule import enable_cuda_graphs

    model = _build("[*E]", pg, moe_shared_expert_intermediate_size=64)
    stand_in = StandIn()
    report = enable_cuda_graphs(model, capture=stand_in)
    _step(model)
    moe = "decoder.layers.0.layers.1.mlp"
    assert f"{moe}.shared_experts" in report.graphed
    assert set(report.eager) == {
        f"{moe}.experts (experts)",
        f"{moe} (dispatch_preprocess)",
        f"{moe} (dispatch)",
        f"{moe} (combine)",
    }
    assert "dynamic shapes" in report.eager[f"{moe}.experts (experts)"]
    assert "all-to-all" in report.eager[f"{moe} (dispatch)"]
    replayed = stand_in.names(model, stand_in.replayed)
    assert not any(name.startswith(f"{moe}.experts") for name in replayed)
    assert f"{moe}.router" in replayed


@pytest.mark.parametrize(
    ("changes", "graphed"),
    [
        ({}, {"mlp"}),
        ({"moe_shared_expert_intermediate_size": 64}, {"mlp"}),
        ({"moe_shared_expert_intermediate_size": 64, "moe_shared_expert_overlap": True},
         {"mlp.router", "mlp.experts"}),
    ],
    ids=["routed", "shared-experts", "shared-expert-overlap"],
)  # fmt: skip
def test_fast_path_moe_layer_is_one_piece_at_ep1(pg, changes, graphed):
    """Behind the sync-free dispatcher at EP 1 nothing in the MoE layer reads the host and every
    shape is fixed: the whole layer is one piece (router, permutation, grouped-GEMM experts,
    unpermutation, shared experts), bitwise. With the shared experts on a side stream
    (``moe_shared_expert_overlap``) the router and the experts are graphed apart and the rest
    says why it runs eager (the control)."""
    from megatron_hybrid.schedule import enable_cuda_graphs

    pattern = "[*E]"
    reference = _build(pattern, pg, local_impl="fast", **changes)
    model = _build(pattern, pg, like=reference, local_impl="fast", **changes)
    stand_in = StandIn()
    report = enable_cuda_graphs(model, capture=stand_in)
    layer = "decoder.layers.0.layers.1"
    assert {n for n in report.graphed if n.startswith(layer)} == {f"{layer}.{g}" for g in graphed}
    eager = {n for n in report.eager if n.startswith(layer)}
    if graphed == {"mlp"}:
        assert not eager
    else:
        assert f"{layer}.mlp.shared_experts (shared_experts)" in eager
        assert "side stream" in report.eager[f"{layer}.mlp.shared_experts (shared_experts)"]
    for seed in (0, 1):
        _assert_same(_step(model, seed), _step(reference, seed))
    assert {f"{layer}.{g}" for g in graphed} <= stand_in.names(model, stand_in.replayed)


def test_negative_control_a_wrong_graph_is_caught(pg):
    """A graph whose output is off by 1e-3 relative must fail the bitwise comparison."""
    from megatron_hybrid.schedule import enable_cuda_graphs

    reference = _build("[*E]", pg)
    model = _build("[*E]", pg, like=reference)
    enable_cuda_graphs(model, capture=StandIn(perturb=1.001))
    with pytest.raises(AssertionError, match="loss"):
        _assert_same(_step(model), _step(reference))


def test_new_lengths_beyond_the_signature_limit_run_eager(pg, caplog):
    """Variable-length micro-batches: a piece captures its first MAX_SIGNATURES lengths, then
    new lengths run eager (said once per piece), known lengths still replay; bitwise either way."""
    from megatron_hybrid.schedule import enable_cuda_graphs
    from megatron_hybrid.schedule.graphs import MAX_SIGNATURES

    reference = _build("[*-]", pg)
    model = _build("[*-]", pg, like=reference)
    stand_in = StandIn()
    report = enable_cuda_graphs(model, capture=stand_in)
    lengths = [8 + 2 * i for i in range(MAX_SIGNATURES + 2)] + [8]
    for seed, seq in enumerate(lengths):
        inputs = model_inputs(seq=seq, seed=seed)
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        model(**inputs).float().mean().backward()
        reference(**inputs).float().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
    reason = f"more than {MAX_SIGNATURES} input shapes"
    for graphed in report.graphed.values():
        assert graphed.captures == MAX_SIGNATURES
        assert graphed.replays == MAX_SIGNATURES + 1  # the first length again replays
        [(eager_reason, calls)] = graphed.eager_calls.items()
        assert eager_reason.startswith(reason) and calls == 2
    warned = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
    assert len(warned) == len(report.graphed)  # once per piece
    # The warning names what varies: here the sequence length of the first tensor argument.
    first = lengths[MAX_SIGNATURES]
    assert all(f"this call's argument 0: (({first}, " in message for message in warned), warned


def test_eval_and_no_grad_run_eager(pg):
    from megatron_hybrid.schedule import enable_cuda_graphs

    model = _build("[*-]", pg)
    stand_in = StandIn()
    report = enable_cuda_graphs(model, capture=stand_in)
    with torch.no_grad():
        model(**model_inputs())
    assert stand_in.captured == []
    reasons = {r for g in report.graphed.values() for r in g.eager_calls}
    assert reasons == {"no backward (eval or no_grad) would free a graph"}


def test_default_capture_off_cuda_falls_back_eager_with_reason(pg):
    """``hybrid_cuda_graphs=True`` on the CPU: the real capture refuses, the model runs eager."""
    reference = _build("[*-]", pg)
    torch.manual_seed(3)
    pattern = "[*-]"
    model = build_hybrid(small_config(pattern), pattern, pg, hybrid_cuda_graphs=True)
    model.load_state_dict(reference.state_dict())
    _assert_same(_step(model), _step(reference))
    for graphed in model.hybrid_cuda_graphs.graphed.values():
        assert graphed.disabled == "capture failed: inputs are not on a CUDA device"
        assert graphed.captures == 0


@pytest.mark.parametrize(
    "changes, match",
    [
        pytest.param(dict(recompute_granularity="full", recompute_method="uniform",
                          recompute_num_layers=1), "recompute_granularity='full'", id="recompute"),
        pytest.param(dict(cuda_graph_impl="local"), "cuda_graph_impl='local'",
                     id="megatron-graphs"),
    ],
)  # fmt: skip
def test_refuses_settings_it_cannot_capture(pg, changes, match):
    from megatron_hybrid.schedule import check_cuda_graph_config

    config = small_config("[*-]", **changes)
    with pytest.raises(ValueError, match=match):
        check_cuda_graph_config(config)


def test_enabling_twice_is_refused_and_disable_restores(pg):
    from megatron_hybrid.schedule import disable_cuda_graphs, enable_cuda_graphs

    reference = _build("[*-]", pg)
    model = _build("[*-]", pg, like=reference)
    report = enable_cuda_graphs(model, capture=StandIn())
    with pytest.raises(ValueError, match="graphed already"):
        enable_cuda_graphs(model, capture=StandIn())
    disable_cuda_graphs(report)
    stand_in = StandIn()
    enable_cuda_graphs(model, capture=stand_in)
    _assert_same(_step(model), _step(reference))
    assert stand_in.captured


# ---- the EP-overlap plan on two gloo ranks ------------------------------------------------

PLAN_CASES = {
    "attention-moe-x2": dict(pattern="[*E]{2}"),
    "gated-delta-net-moe": dict(pattern="[GE]{2}"),
    # Local linears compute their weight gradients inside the (captured) backward; the slots'
    # backward_dw calls then find nothing queued, graphed or not.
    "delay-wgrad-compute": dict(pattern="[*E]{2}", overlap=dict(delay_wgrad_compute=True)),
}


def plan_worker(rank, world_size, cases):
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.schedule import enable_cuda_graphs
    from megatron_hybrid.testing.overlap import compare_overlap

    results = {}
    for name, case in cases.items():
        pattern = case["pattern"]
        if "G" in pattern:
            try:
                import fla  # noqa: F401
            except ImportError:
                results[name] = None
                continue
        pg = initialize_model_parallel(ep=2, seed=5)
        config = small_config(
            pattern, expert_model_parallel_size=2, bf16=True, params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
        )  # fmt: skip
        runs, stand_ins = {}, {}
        for graphed in (False, True):
            stand_in = StandIn()

            def build(run_config, graphed=graphed, stand_in=stand_in, pattern=pattern, pg=pg,
                      stand_ins=stand_ins):  # fmt: skip
                torch.manual_seed(3)
                model = build_hybrid(run_config, pattern, pg)
                if not graphed:
                    stand_ins["weights"] = {
                        k: v.clone() if torch.is_tensor(v) else v
                        for k, v in model.state_dict().items()
                    }
                else:
                    model.load_state_dict(stand_ins["weights"])
                    enable_cuda_graphs(model, capture=stand_in)
                    stand_ins["model"] = model
                return [Float16Module(run_config, model)]

            runs[graphed] = compare_overlap(
                build, config, steps=2, lr=1e-2, num_microbatches=4, schedules=("overlap",),
                overlap_overrides=case.get("overlap"),
            )["overlap"]  # fmt: skip
            stand_ins[graphed] = stand_in
        stand_in, model = stand_ins[True], stand_ins["model"]
        results[name] = dict(
            losses=(runs[False]["losses"], runs[True]["losses"]),
            differing=[
                n
                for step, ref in zip(runs[True]["grads"], runs[False]["grads"], strict=True)
                for n in ref
                if not torch.equal(step[n], ref[n])
            ],
            captures=len(stand_in.captured),
            replays=len(stand_in.replayed),
            replayed=sorted(stand_in.names(model, stand_in.replayed)),
        )
    return results


@pytest.fixture(scope="module")
def plan_results():
    from megatron_hybrid.testing.spawn import run_distributed

    return run_distributed(plan_worker, 2, PLAN_CASES, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_overlap_plan_replays_graphed_pieces_bitwise(plan_results, name):
    layers = 2
    for rank, results in enumerate(plan_results):
        result = results[name]
        if result is None:
            pytest.skip("GatedDeltaNet needs fla")
        plain, graphed = result["losses"]
        assert plain == graphed, f"rank {rank}: losses {graphed} != {plain}"
        assert result["differing"] == [], f"rank {rank}: gradients differ"
        mixer = "self_attention"
        expected = {
            f"decoder.layers.{i}.layers.{j}"
            for i in range(layers)
            for j in (f"0.{mixer}", "1.mlp.router")
        }
        assert set(result["replayed"]) == expected, f"rank {rank}"
        # 2 steps x 4 micro-batches, every piece once per micro-batch.
        assert result["replays"] == 2 * 4 * len(expected)
        # Graph instances are given back by backward: at most two micro-batches of one layer
        # are in flight under combined 1F1B, so at most two captures per piece, not eight.
        assert len(expected) <= result["captures"] <= 2 * len(expected), f"rank {rank}"


def test_te_linears_with_delayed_wgrad_stay_eager():
    """A piece holding a TransformerEngine linear under ``delay_wgrad_compute`` is not captured."""
    from types import SimpleNamespace

    from torch import nn

    from megatron_hybrid.modules.layer_types.common import delayed_wgrad_reason

    te_linear = type("Linear", (nn.Linear,), {"__module__": "transformer_engine.pytorch.module",
                                              "backward_dw": lambda self: None})  # fmt: skip
    piece = nn.Sequential(te_linear(4, 4))
    for delay, expected in ((True, "delay_wgrad_compute with TransformerEngine"), (False, None)):
        piece.config = SimpleNamespace(delay_wgrad_compute=delay)
        reason = delayed_wgrad_reason(piece)
        assert reason == expected if expected is None else expected in reason
    local = nn.Sequential(nn.Linear(4, 4))
    local.config = SimpleNamespace(delay_wgrad_compute=True)
    assert delayed_wgrad_reason(local) is None


def test_capture_runs_in_thread_local_mode(monkeypatch):
    """``make_graphed_callables`` captures in ``thread_local`` mode (NCCL's watchdog thread)."""
    from megatron_hybrid.schedule import graph_capture

    seen = []

    class FakeGraph:
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            seen.append(capture_error_mode)

    monkeypatch.setattr(torch.cuda, "graph", FakeGraph)
    with graph_capture.thread_local_capture():
        torch.cuda.graph(None, pool=None)
        torch.cuda.graph(None, capture_error_mode="relaxed")
    torch.cuda.graph(None)
    assert seen == ["thread_local", "relaxed", "global"]
    assert torch.cuda.graph is FakeGraph


def test_capture_restores_gradients_and_replays_the_fused_main_grad_flag(pg, monkeypatch):
    """The warm-up's side effects are undone; the flag a fused wgrad sets is set on every replay.

    A fake ``make_graphed_callables`` does what the real warm-up does to state: it adds a dummy
    gradient to ``main_grad``, sets ``grad_added_to_main_grad`` on a fused linear's weight and
    moves a buffer.
    """
    from megatron_hybrid.schedule import enable_cuda_graphs, graph_capture

    model = _build("[*-]", pg)
    mlp = model.decoder.layers[0].layers[1].mlp
    params = list(mlp.parameters())
    for param in params:
        param.main_grad = torch.full_like(param, 0.5)
        param.grad_added_to_main_grad = False
    mlp.register_buffer("counter", torch.zeros(2))
    fused = params[0]

    def fake_make_graphed_callables(piece, sample_args, **kwargs):
        out = piece(*sample_args)
        torch.autograd.grad([o for o in out if o.requires_grad], list(piece.parameters()),
                            [torch.ones_like(o) for o in out if o.requires_grad])  # fmt: skip
        if piece.piece.target is not mlp:  # the attention before it
            return piece
        assert list(piece.parameters()) == params  # autograd reaches each: each a graph input
        for param in piece.parameters():
            param.main_grad.add_(1.0)
        fused.grad_added_to_main_grad = True
        piece.piece.target.counter.add_(1.0)
        return piece

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_make_graphed_callables)
    monkeypatch.setattr(graph_capture, "_on_cuda", lambda tensors: True)
    report = enable_cuda_graphs(model)
    for param in params:
        param.grad_added_to_main_grad = False
    model.zero_grad(set_to_none=True)
    model(**model_inputs()).float().mean().backward()

    graphed = report.graphed["decoder.layers.0.layers.1.mlp"]
    assert graphed.captures == 1 and graphed.disabled is None
    assert all(torch.equal(p.main_grad, torch.full_like(p, 0.5)) for p in params)
    assert torch.equal(mlp.counter, torch.zeros(2))
    (instance,) = next(iter(graphed.instances.values()))
    assert instance.piece.fused_params == [fused] and not instance.busy
    # Restored after capture, set again when gradient reached the replayed piece.
    assert fused.grad_added_to_main_grad is True
    assert all(p.grad_added_to_main_grad is False for p in params[1:])


class StaticGradStandIn:
    """A stand-in that hands out parameter gradients in persistent buffers, as a replayed
    backward graph does (``torch.cuda.make_graphed_callables`` returns its static gradients)."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []

    def __call__(self, piece, sample_args):
        params = [p for p in piece.parameters() if p.requires_grad]
        static = [torch.zeros_like(p) for p in params]
        self.buffers += static
        count = len(sample_args)

        class Static(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                with torch.enable_grad():
                    ctx.leaves = [
                        t.detach().requires_grad_(t.requires_grad) for t in inputs[:count]
                    ]
                    ctx.outs = piece(*ctx.leaves)
                return tuple(o.detach() for o in ctx.outs)

            @staticmethod
            def backward(ctx, *grads):
                leaves = [t for t in ctx.leaves if t.requires_grad]
                got = torch.autograd.grad(ctx.outs, leaves + params, grads, allow_unused=True)
                by_leaf = dict(zip(map(id, leaves), got[: len(leaves)], strict=True))
                for buffer, grad in zip(static, got[len(leaves) :], strict=True):
                    buffer.copy_(grad)
                return (*(by_leaf.get(id(t)) for t in ctx.leaves), *(b.detach() for b in static))

        return lambda *tensors: Static.apply(*tensors, *params)


def test_accumulated_gradients_never_alias_a_graphs_static_buffer(pg):
    """Two micro-batches accumulate into ``.grad`` as eager ones do (autograd would otherwise
    keep the first static buffer as ``.grad`` and the second backward would overwrite it)."""
    from megatron_hybrid.schedule import enable_cuda_graphs

    reference = _build("[*-]", pg)
    model = _build("[*-]", pg, like=reference)
    enable_cuda_graphs(model, capture=StaticGradStandIn())
    grads = []
    for net in (model, reference):
        net.zero_grad(set_to_none=True)
        for seed in (0, 1):
            net(**model_inputs(seed=seed)).float().mean().backward()
        grads.append({n: p.grad for n, p in net.named_parameters()})
    differing = [n for n in grads[1] if not torch.equal(grads[0][n], grads[1][n])]
    assert not differing, f"accumulated gradients differ: {differing}"


def test_fused_parameters_get_their_placeholder_without_a_copy(pg):
    """A parameter whose captured backward added to ``main_grad`` hands DDP's hook a placeholder
    (which it drops): no copy of it; the others' gradients are copies (negative control)."""
    from megatron_hybrid.schedule import enable_cuda_graphs

    model = _build("[*-]", pg)
    stand_in = StaticGradStandIn()
    enable_cuda_graphs(model, capture=stand_in)
    mlp = model.decoder.layers[0].layers[1].mlp
    fused, plain = list(mlp.parameters())[:2]
    fused.grad_added_to_main_grad, plain.grad_added_to_main_grad = True, False
    seen = {}
    for name, param in (("fused", fused), ("plain", plain)):
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.__setitem__(name, p.grad.untyped_storage().data_ptr())
        )
    model.zero_grad(set_to_none=True)
    model(**model_inputs()).float().mean().backward()
    static = {t.untyped_storage().data_ptr() for t in stand_in.buffers}
    assert seen["fused"] in static and seen["plain"] not in static


def test_attention_dropout_keeps_attention_eager(pg):
    from megatron_hybrid.schedule import enable_cuda_graphs

    model = _build("[*-]", pg, attention_dropout=0.1)
    report = enable_cuda_graphs(model, capture=StandIn())
    assert set(report.graphed) == {"decoder.layers.0.layers.1.mlp"}
    reason = report.eager["decoder.layers.0.layers.0.self_attention (mixer)"]
    assert "attention_dropout=0" in reason


def test_failed_capture_reports_its_cause_and_leaves_the_stream(monkeypatch):
    """``capture_end`` after a failed operation raises too: the operation's error is the one
    reported, and the capture's stream context is left either way."""
    from megatron_hybrid.schedule import graph_capture

    exited = []

    class FakeGraph:
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            self.cuda_graph = cuda_graph
            self.stream_ctx = type("Ctx", (), {"__exit__": lambda s, *a: exited.append(a[0])})()

        def __enter__(self):
            return self

    class EndFails:
        def capture_end(self):
            raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "graph", FakeGraph)
    with graph_capture.thread_local_capture():
        with pytest.raises(ValueError, match="the cause"):
            with torch.cuda.graph(EndFails()):
                raise ValueError("the cause: a host sync")
        with pytest.raises(RuntimeError, match="previous error"):  # no cause: capture_end's
            with torch.cuda.graph(EndFails()):
                pass
    assert exited == [ValueError, None]


class FakeGenerator:
    def __init__(self):
        self.state = "capturing"

    def clone_state(self):
        return "saved"

    def graphsafe_set_state(self, state):
        self.state = state


@pytest.mark.parametrize("under_way", [True, False], ids=["capture-under-way", "capture-ended"])
def test_recovery_restores_the_generator_and_frees_the_pool(monkeypatch, under_way):
    """The generator gets its pre-capture state; the pool is ended and released only where the
    capture never ended (else the graph's own reset releases it: releasing twice would corrupt
    the allocator's count)."""
    from megatron_hybrid.schedule import graph_capture

    calls = []

    def end(device, pool):
        calls.append(("end", device, pool))
        if not under_way:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    generator = FakeGenerator()
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 7))
    monkeypatch.setattr(torch.cuda, "default_generators", [generator], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool",
                        lambda device, pool: calls.append(("release", device, pool)),
                        raising=False)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty",)))
    state = graph_capture._ProcessState(torch.device("cuda", 0))
    assert state.recover() == []
    assert generator.state == "saved"
    expected = [("end", 0, (0, 7))] + ([("release", 0, (0, 7))] if under_way else [])
    assert calls == [*expected, ("empty",)]


def test_failed_capture_recovers_after_restoring_the_piece(monkeypatch, pg):
    from megatron_hybrid.schedule import graph_capture

    model = _build("[*-]", pg)
    mlp = model.decoder.layers[0].layers[1].mlp
    for param in mlp.parameters():
        param.main_grad = torch.full_like(param, 0.5)
    events = []

    def failing(piece, sample_args, **kwargs):
        for param in piece.parameters():
            param.main_grad.add_(1.0)  # what a warm-up does before the capture fails
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    class State:
        def __init__(self, device):
            self.pool = None

        def recover(self):
            events.append([float(p.main_grad.mean()) for p in mlp.parameters()])
            return []

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", failing)
    monkeypatch.setattr(graph_capture, "_on_cuda", lambda tensors: True)
    monkeypatch.setattr(graph_capture, "_ProcessState", State)
    x = torch.randn(4, 1, 64)
    with pytest.raises(graph_capture.GraphCaptureError, match="^RuntimeError: Cannot copy"):
        graph_capture.capture_cuda_graph(mlp, (x,))
    assert events == [[0.5] * len(list(mlp.parameters()))]  # recovered once, grads restored


def test_the_digest_says_what_replayed_and_why_the_rest_ran_eager(pg):
    """What ``train --hybrid-cuda-graphs`` prints after its first step: pieces that replayed, and
    each reason graphed pieces ran eager (a packed micro-batch's ``PackedSeqParams``, evaluation),
    through the model's wrappers. Control: before any call nothing has replayed."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hybrid.schedule import enable_cuda_graphs
    from megatron_hybrid.schedule.graphs import PACKED_REASON, _split, graphs_digest

    model = build_hybrid(small_config("[*-]"), "[*-]", pg)
    model.hybrid_cuda_graphs = enable_cuda_graphs(model, capture=StandIn())  # as HybridModel does
    wrapper = torch.nn.Module()  # as DDP and Float16Module hold it
    wrapper.module = model
    wrapped = [wrapper]
    assert graphs_digest(wrapped) == "0 of 2 graphed pieces replay"
    _step(model)
    assert graphs_digest(wrapped) == "2 of 2 graphed pieces replay"
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 8]))
    assert _split((torch.ones(2),), {"packed_seq_params": packed}) == PACKED_REASON
    with torch.no_grad():
        model(**model_inputs(seed=1))
    digest = graphs_digest(wrapped)
    assert digest.startswith("2 of 2 graphed pieces replay; 2 ran eager (2 calls): no backward")


class StaticInputStandIn(StandIn):
    """A stand-in that keeps, as a graph does, the capture's input tensors and copies each
    replay's inputs into them; ``stale`` skips the integer ones (boundaries captured as
    constants rather than graph inputs: the deliberate bug of the negative control)."""

    def __init__(self, stale: bool = False):
        super().__init__()
        self.stale = stale

    def __call__(self, piece, sample_args):
        static = [t.detach().clone() for t in sample_args]
        run = super().__call__(piece, sample_args)

        def replay(*tensors):
            inputs = []
            for buffer, value in zip(static, tensors, strict=True):
                if value.is_floating_point():
                    inputs.append(value)  # autograd must reach the caller's tensors
                else:
                    if not self.stale:
                        buffer.copy_(value)
                    inputs.append(buffer)
            return run(*inputs)

        return replay


#: Sequences per packed row of 64 tokens, each padded to a multiple of 4 (pad rows between them
#: and after the last): 3, 5 and 2 share capacity 8, 10 needs 16.
PACKED_ROWS = [[10, 20, 18], [5, 9, 11, 13, 10], [3] * 9 + [12], [7, 41]]


def _packed_steps(model, rows=PACKED_ROWS) -> list:
    out = []
    for seed, lengths in enumerate(rows):
        batch = pack_apart(lengths, total=64, seed=seed)
        model.zero_grad(set_to_none=True)
        ids = batch.tensors["input_ids"]
        logits = model(ids, batch.tensors["position_ids"], None,
                       packed_seq_params=batch.packed_seq_params)  # fmt: skip
        loss = logits.float().square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((loss.detach(), grads))
    return out


@pytest.mark.parametrize(
    "pattern",
    ["[*-]", "[+-]", "[G-]", "[M-]"],
    ids=["attention", "mla", "gated-delta-net", "mamba"],
)
def test_packed_micro_batches_replay_the_fixed_boundary_mixers(pg, pattern):
    """Packed rows with 3, 5, 10 and 2 sequences (one row length): the fast attention (MLA's
    too, which sizes its own rotary table), GatedDeltaNet (its fla contract; the CPU runtime's
    stand-ins here) and the torch Mamba mixer (``seq_idx`` made on the device) take fixed-size
    boundaries as graph inputs, so capacity 8 and 16 are one capture each and every call
    replays, bitwise the ungraphed model's. Negative control: boundaries kept from the capture
    (not graph inputs) give other losses from the second row on."""
    from megatron_hybrid.schedule import enable_cuda_graphs

    _needs(pattern)
    # GatedDeltaNet takes packed rows on fla's contract, not megatron's deterministic torch path.
    changes = {"deterministic_mode": False} if "G" in pattern else {}
    reference = _build(pattern, pg, local_impl="fast", **changes)
    models = {stale: _build(pattern, pg, like=reference, local_impl="fast", **changes)
              for stale in (False, True)}  # fmt: skip
    report = enable_cuda_graphs(models[False], capture=StaticInputStandIn())
    enable_cuda_graphs(models[True], capture=StaticInputStandIn(stale=True))

    expected = _packed_steps(reference)
    for got, want in zip(_packed_steps(models[False]), expected, strict=True):
        _assert_same(got, want)
    (mixer,) = (g for n, g in report.graphed.items() if n.startswith("decoder.layers.0.layers.0"))
    assert (mixer.captures, mixer.replays, mixer.eager_calls) == (2, 4, {})
    mlp = report.graphed["decoder.layers.0.layers.1.mlp"]
    assert (mlp.captures, mlp.replays) == (1, 4)

    stale = [loss for loss, _ in _packed_steps(models[True])]
    assert torch.equal(stale[0], expected[0][0])
    assert not torch.equal(stale[1], expected[1][0]), "stale boundaries went unnoticed"


def test_a_failed_packed_capture_keeps_padded_rows_replaying(pg, caplog):
    """Where a piece's device-only path does not run (here: the capture of its packed call
    fails), its packed calls run eager from then on with the failure as their reason, once
    warned, and its padded calls still replay; bitwise either way."""
    from megatron_hybrid.schedule import enable_cuda_graphs
    from megatron_hybrid.schedule.graph_capture import GraphCaptureError

    class PackedFails(StandIn):
        def __call__(self, piece, sample_args):
            if any(not t.is_floating_point() for t in sample_args):
                raise GraphCaptureError("RuntimeError: a host read of the boundaries")
            return super().__call__(piece, sample_args)

    reference = _build("[*-]", pg, local_impl="fast")
    model = _build("[*-]", pg, like=reference, local_impl="fast")
    report = enable_cuda_graphs(model, capture=PackedFails())
    rows = PACKED_ROWS[:2]
    for got, want in zip(_packed_steps(model, rows), _packed_steps(reference, rows), strict=True):
        _assert_same(got, want)
    _assert_same(_step(model), _step(reference))
    attention = report.graphed["decoder.layers.0.layers.0.self_attention"]
    reason = "packed micro-batches: capture failed: RuntimeError: a host read of the boundaries"
    assert attention.disabled is None and attention.packed_reason == reason
    assert attention.eager_calls == {reason: 2} and attention.replays == 1
    assert sum(reason in r.getMessage() for r in caplog.records) == 1


def test_packed_micro_batches_run_reference_attention_eager(pg):
    """The reference attention reads packed boundaries on the host: its packed calls run eager
    and say so; the MLP still replays; bitwise either way."""
    from megatron_hybrid.schedule import enable_cuda_graphs
    from megatron_hybrid.schedule.graphs import PACKED_REASON

    reference = _build("[*-]", pg)
    model = _build("[*-]", pg, like=reference)
    report = enable_cuda_graphs(model, capture=StaticInputStandIn())
    rows = PACKED_ROWS[:2]
    for got, want in zip(_packed_steps(model, rows), _packed_steps(reference, rows), strict=True):
        _assert_same(got, want)
    attention = report.graphed["decoder.layers.0.layers.0.self_attention"]
    assert attention.captures == 0 and attention.eager_calls == {PACKED_REASON: 2}
    assert report.graphed["decoder.layers.0.layers.1.mlp"].replays == 2


@pytest.mark.parametrize("graphed", [True, False], ids=["graphed", "control-ungraphed"])
def test_both_schedules_size_the_rotary_table_by_the_row(pg, graphed):
    """The rotary table comes from ``HybridModel._preprocess``, which the plain forward and the
    EP-overlap plan's pre-process node (megatron-core's ``PreProcessNode``, with the micro-batch's
    own boundaries) both call: with the package's graphs it is as long as the row plus one
    whatever the longest sequence, so graphed attention replays one shape in both schedules
    (the overlap plan's table followed each micro-batch's longest sequence, and attention ran
    eager from its fifth one). Control: without graphs it follows the longest sequence."""
    from megatron_hybrid.schedule import enable_cuda_graphs

    model = _build("[*-]", pg, local_impl="fast")
    if graphed:
        enable_cuda_graphs(model, capture=StandIn())
    lengths, longest = [], []
    for rows in PACKED_ROWS:
        batch = pack_apart(rows, total=64)
        longest.append(batch.packed_seq_params.max_seqlen_q)
        outputs = model._preprocess(
            input_ids=batch.tensors["input_ids"], position_ids=batch.tensors["position_ids"],
            decoder_input=None, packed_seq_params=batch.packed_seq_params, padding_mask=None,
        )  # fmt: skip
        lengths.append(outputs[1].shape[0])  # the rotary table
    assert len(set(longest)) == len(PACKED_ROWS)  # every micro-batch another longest
    assert lengths == ([65] * len(PACKED_ROWS) if graphed else longest)

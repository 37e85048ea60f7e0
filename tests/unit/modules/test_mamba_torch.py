"""The torch Mamba2 path against a token-by-token recurrence, and against megatron-core's layout.

float32 on the CPU. The reference in this file runs a whole Mamba2 mixer one time step at a time
from the module's parameters (in_proj, causal conv, the SSM recurrence, the D skip, the gate, the
grouped RMS norm, out_proj) with no chunking; the chunked path must match its outputs and the
gradients of the input and every parameter. Deliberately wrong references (no D skip, one norm
group, heads assigned to B/C groups round-robin) must not match. megatron-core's own
``MambaMixer`` is then built on the CPU (its mamba_ssm import check and gated norm stubbed) to
check that both classes make the same parameters from the same seed and the same checkpoint keys.
Packed input must equal separate runs per sequence; TP2 (with and without SP) and CP2 on two
gloo ranks must equal the single-rank layer.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from rounding import float32_bounds
from torch.nn.functional import silu, softplus

from megatron_hybrid.testing.overlap import rel_error

# The floor of the relative error (norm-relative) allowed between two float32 evaluations; each
# result's bound is derived from its reference computation (``_bounds``: the margin times
# its float32 rounding scale where that is larger), so it holds on any machine. A wrong decay,
# chunk boundary, grouping or gradient is off by far more; the negative controls use the floor.
FP32_REL_TOL = 1e-5
HIDDEN, HEAD_DIM, STATE, BATCH = 16, 4, 8, 2  # 2 * 16 / 4 = 8 heads


def _config(groups: int, **overrides):
    from megatron_hybrid.testing.models import small_config

    sizes = dict(mamba_head_dim=HEAD_DIM, mamba_state_dim=STATE, mamba_num_groups=groups)
    return small_config("M", hidden_size=HIDDEN, **{**sizes, **overrides})


def _mixer(pg, groups: int, seed: int = 3, cls=None, config: dict | None = None, **kwargs):
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        model_parallel_cuda_manual_seed,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_hybrid.modules.mamba_torch import TorchMambaMixer

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    spec = ModuleSpec(
        module=cls or TorchMambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
    )
    return build_module(
        spec, _config(groups, **(config or {})), d_model=HIDDEN, pg_collection=pg, **kwargs
    )


def _stepwise_mixer(mixer, hidden: torch.Tensor, bug: str | None = None) -> torch.Tensor:
    """The mixer one time step at a time, from its parameters; ``[S, B, H]`` -> ``[S, B, H]``.

    ``bug`` plants a known mistake: ``"no_D"`` drops the skip, ``"one_norm_group"`` normalises
    all channels together, ``"round_robin_groups"`` gives head ``h`` group ``h % G`` instead of
    megatron-core's contiguous ``h // (H / G)``.
    """
    heads, head_dim, state = mixer.nheads, mixer.headdim, mixer.d_state
    groups, d_inner, width = mixer.ngroups, mixer.d_inner, mixer.d_conv
    seq, batch, _ = hidden.shape
    proj = hidden @ mixer.in_proj.weight.t()  # [S, B, z x B C dt]
    z, xbc, dt = proj.split([d_inner, d_inner + 2 * groups * state, heads], dim=-1)
    weight, bias = mixer.conv1d_weight[:, 0], mixer.conv1d_bias
    a = -torch.exp(mixer.A_log)
    d_skip = mixer.D.view(heads, head_dim) if mixer.D_has_hdim else mixer.D[:, None]
    ssm = hidden.new_zeros(batch, heads, head_dim, state)
    outputs = []
    for t in range(seq):
        conv = bias.expand(batch, -1)
        for tap in range(width):  # tap W-1 reads step t, tap 0 reads step t - W + 1
            src = t - (width - 1 - tap)
            if src >= 0:
                conv = conv + xbc[src] * weight[:, tap]
        x, b, c = silu(conv).split([d_inner, groups * state, groups * state], dim=-1)
        x = x.view(batch, heads, head_dim)
        b, c = b.view(batch, groups, state), c.view(batch, groups, state)
        step = softplus(dt[t] + mixer.dt_bias)  # [B, heads]
        if bug == "round_robin_groups":
            group_of = [h % groups for h in range(heads)]
        else:
            group_of = [h // (heads // groups) for h in range(heads)]
        b_h, c_h = b[:, group_of], c[:, group_of]  # [B, heads, N]
        decay = torch.exp(step * a)[..., None, None]
        ssm = decay * ssm + (step[..., None] * x)[..., None] * b_h[:, :, None, :]
        y = (ssm * c_h[:, :, None, :]).sum(-1)
        if bug != "no_D":
            y = y + d_skip * x
        y = y.reshape(batch, d_inner) * silu(z[t])
        if mixer.rmsnorm:
            norm_groups = 1 if bug == "one_norm_group" else groups
            y = y.view(batch, norm_groups, -1)
            y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + 1e-5)
            y = y.reshape(batch, d_inner) * mixer.norm.weight
        outputs.append(y)
    return torch.stack(outputs) @ mixer.out_proj.weight.t()


def _randomise(mixer, seed: int) -> None:
    """Parameters under which every term matters.

    At initialisation the steps are tiny (softplus(dt_bias) in [0.001, 0.1]), so the scan adds
    little next to the D skip, and D and the norm weight are constants. Here steps are ~0.3-1.3
    and decays weak enough (A in [0.02, 1]) for the state to carry across chunk boundaries.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mixer.dt_bias.copy_(torch.randn(mixer.dt_bias.shape, generator=gen))
        mixer.A_log.uniform_(-4.0, 0.0, generator=gen)
        mixer.D.copy_(torch.randn(mixer.D.shape, generator=gen))
        if mixer.rmsnorm:
            mixer.norm.weight.add_(0.5 * torch.randn(mixer.norm.weight.shape, generator=gen))


def _outputs_and_grads(fn, mixer, hidden, grad_out, rounding=None) -> dict[str, torch.Tensor]:
    """Output of ``fn`` (None: the mixer's own forward) and the gradients of input and params.

    Args:
        fn: ``hidden -> output``, or None for the mixer's own forward.
        mixer: The mixer whose parameters' gradients are returned.
        hidden: ``[S, B, H]`` input.
        grad_out: Gradient of the output.
        rounding: Context manager the forward and backward arithmetic runs in (none: plain).

    Returns:
        ``{"out", "dhidden", "d<parameter>": ...}``, detached.
    """
    mixer.zero_grad(set_to_none=True)
    leaf = hidden.detach().clone().requires_grad_()
    with rounding or contextlib.nullcontext():
        out = mixer(leaf)[0] if fn is None else fn(leaf)
        out.backward(grad_out)
    # A planted bug can leave a parameter out of the graph: its gradient is then zero.
    grads = {
        f"d{name}": p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for name, p in mixer.named_parameters()
    }
    return {"out": out.detach(), "dhidden": leaf.grad, **grads}


def _bounds(evaluate) -> dict[str, float]:
    """The relative error each reference result may carry on any machine.

    Args:
        evaluate: ``evaluate(rounding)`` recomputes the reference results from the same inputs
            and weights, their arithmetic inside ``rounding`` (see ``rounding.float32_bounds``).

    Returns:
        ``name -> max(FP32_REL_TOL, margin x the result's float32 rounding scale)``.
    """
    return float32_bounds(evaluate, measure=rel_error, floor=FP32_REL_TOL)


def _over_bound(errors: dict[str, float], bounds: dict[str, float]) -> list[tuple]:
    """``(name, relative error, bound)`` of every error over its bound; empty if none."""
    return [
        (name, error, bounds[name]) for name, error in errors.items() if not error <= bounds[name]
    ]


def _inputs(seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden, grad_out)``, both ``[S, B, H]``, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seq, BATCH, HIDDEN, generator=gen)
    return hidden, torch.randn(seq, BATCH, HIDDEN, generator=gen)


def _stepwise(mixer, seq: int, seed: int, bug: str | None = None, rounding=None) -> dict:
    """The stepwise reference's output and gradients on :func:`_inputs`."""
    hidden, grad_out = _inputs(seq, seed)
    return _outputs_and_grads(
        lambda h: _stepwise_mixer(mixer, h, bug), mixer, hidden, grad_out, rounding
    )


def _compare(mixer, seq: int, seed: int, bug: str | None = None) -> dict[str, float]:
    chunked = _outputs_and_grads(None, mixer, *_inputs(seq, seed))
    stepwise = _stepwise(mixer, seq, seed, bug)
    return {name: rel_error(chunked[name], stepwise[name]) for name in stepwise}


@pytest.mark.parametrize("groups", [1, 2, 4], ids=["g1", "g2", "g4"])
@pytest.mark.parametrize(
    "seq, chunk_size",
    [(24, 8), (24, 24), (23, 8), (24, 5), (10, 128)],
    ids=["divides", "one-chunk", "ragged-tail", "chunk5", "chunk-longer-than-seq"],
)
def test_chunked_path_matches_stepwise_recurrence(pg, groups, seq, chunk_size):
    mixer = _mixer(pg, groups, chunk_size=chunk_size)
    _randomise(mixer, seed=groups)
    errors = _compare(mixer, seq, seed=seq + chunk_size)
    assert len(errors) == 2 + len(list(mixer.parameters()))  # output, input and every parameter
    bounds = _bounds(lambda rounding: _stepwise(mixer, seq, seq + chunk_size, rounding=rounding))
    over = _over_bound(errors, bounds)
    assert not over, f"(name, error, bound) over the bound: {over}"


@pytest.mark.parametrize(
    "options",
    [dict(D_has_hdim=True), dict(rmsnorm=False), dict(conv_init=0.3, d_conv=3)],
    ids=["D-per-channel", "no-rmsnorm", "conv3"],
)
def test_mixer_options_match_stepwise_recurrence(pg, options):
    mixer = _mixer(pg, 2, chunk_size=8, **options)
    _randomise(mixer, seed=5)
    errors = _compare(mixer, 20, seed=11)
    bounds = _bounds(lambda rounding: _stepwise(mixer, 20, 11, rounding=rounding))
    over = _over_bound(errors, bounds)
    assert not over, f"(name, error, bound) over the bound: {over}"


@pytest.mark.parametrize("bug", ["no_D", "one_norm_group", "round_robin_groups"])
def test_wrong_reference_is_caught(pg, bug):
    """Negative control: each planted mistake moves the output far beyond the tolerance."""
    mixer = _mixer(pg, 2, chunk_size=8)
    _randomise(mixer, seed=2)
    errors = _compare(mixer, 24, seed=4, bug=bug)
    assert errors["out"] > 100 * FP32_REL_TOL, errors


def test_packed_sequences_restart_state_and_conv():
    """With ``seq_idx`` the scan and conv equal separate runs over each packed sequence."""
    from megatron_hybrid.modules.ssd import causal_conv1d, ssd_chunk_scan

    gen = torch.Generator().manual_seed(0)
    lengths, heads, head_dim, groups, state = [7, 12, 5], 4, 3, 2, 5
    seq = sum(lengths)
    x = torch.randn(1, seq, heads, head_dim, generator=gen)
    dt = softplus(torch.randn(1, seq, heads, generator=gen))
    a = -torch.rand(heads, generator=gen) - 0.05
    b, c = (torch.randn(1, seq, groups, state, generator=gen) for _ in range(2))
    d = torch.randn(heads, generator=gen)
    xbc = torch.randn(1, seq, 6, generator=gen)
    w, wb = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]

    packed_y = ssd_chunk_scan(x, dt, a, b, c, 4, d=d, seq_idx=seq_idx)
    packed_conv = causal_conv1d(xbc, w, wb, seq_idx=seq_idx)
    starts = [0, 7, 19]
    for start, length in zip(starts, lengths, strict=True):
        part = slice(start, start + length)
        alone = ssd_chunk_scan(x[:, part], dt[:, part], a, b[:, part], c[:, part], 4, d=d)
        torch.testing.assert_close(packed_y[:, part], alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(packed_conv[:, part], causal_conv1d(xbc[:, part], w, wb))
    # Without seq_idx the later sequences see the earlier ones (the check above can fail).
    unpacked = ssd_chunk_scan(x, dt, a, b, c, 4, d=d)
    assert rel_error(unpacked[:, 7:], packed_y[:, 7:]) > 1e-2


@pytest.mark.parametrize("tf32", [False, True], ids=["float32", "tf32-operator"])
def test_packed_scan_traces_as_one_graph(monkeypatch, tf32):
    """The fast path compiles ``mamba2_scan`` with ``seq_idx`` (packed rows): TorchDynamo traces
    it, forward and backward, as one graph (``fullgraph``: no break, no eager fallback inside),
    and the traced function equals the eager one with the boundaries applied (control: without
    ``seq_idx`` the later sequences differ). ``aot_eager`` runs the traced graph with eager
    kernels, so this checks the tracing on a CPU; inductor's kernels are a GPU test's matter
    (``tests/functional/test_mamba_torch_gpu.py``). With ``tf32`` (what the fast path passes on
    CUDA) the products go through the custom operator of ``kernels/tf32.py``, one node of the
    graph each."""
    import torch._dynamo

    from megatron_hybrid.modules.ssd import mamba2_scan

    heads, head_dim, groups, state, lengths = 4, 8, 2, 8, [9, 23, 14]
    seq, d_inner = sum(lengths), heads * head_dim
    conv_dim = d_inner + 2 * groups * state
    gen = torch.Generator().manual_seed(4)
    zxbcdt = torch.randn(1, seq, 2 * d_inner + 2 * groups * state + heads, generator=gen)
    params = [torch.randn(conv_dim, 4, generator=gen), torch.randn(conv_dim, generator=gen),
              torch.randn(heads, generator=gen), torch.rand(heads, generator=gen).log(),
              torch.randn(heads, generator=gen)]  # fmt: skip
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    sizes = dict(heads=heads, groups=groups, state=state, head_dim=head_dim, chunk_size=16)

    def run(fn, ids, tf32=False):
        inputs = [t.clone().requires_grad_() for t in (zxbcdt, *params)]
        out = fn(*inputs, ids, **sizes, tf32=tf32)
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in inputs]

    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # set by the CPU runtime
    with torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        traced = torch.compile(mamba2_scan, backend=backend, fullgraph=True)
        compiled = run(traced, seq_idx, tf32)
    assert len(graphs) == 1, "TorchDynamo did not trace the scan (disabled?)"
    calls = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.megatron_hybrid.tf32_bmm.default) == (5 if tf32 else 0)
    eager = run(mamba2_scan, seq_idx, tf32)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unpacked = run(mamba2_scan, None)[0]
    assert rel_error(unpacked[:, 9:], eager[0][:, 9:]) > 1e-2


@pytest.mark.parametrize(
    "device, environ, expected",
    [pytest.param("cpu", {}, (False, "float32 products"), id="cpu"),
     pytest.param("cuda", {}, (True, "TF32 products"), id="cuda"),
     pytest.param("cuda", {"MEGATRON_HYBRID_SSD_TF32": "0"},
                  (False, "float32 products (MEGATRON_HYBRID_SSD_TF32=0)"), id="switched-off"),
     pytest.param("cuda", {"NVIDIA_TF32_OVERRIDE": "0"},
                  (True, "float32 products (NVIDIA_TF32_OVERRIDE=0)"), id="cublas-override")],
)  # fmt: skip
def test_fast_scan_says_which_products_run(device, environ, expected):
    """The fast path asks for TF32 products on CUDA only, unless its switch is off, and names
    what cuBLAS computes (``fast_path_detail``), float32 where ``NVIDIA_TF32_OVERRIDE=0``."""
    from megatron_hybrid.modules.fast.mamba import scan_products

    assert scan_products(torch.device(device), environ) == expected


@pytest.mark.parametrize("seq", [24, 21], ids=["divides", "ragged"])
def test_matches_transformers_nemotron_h_mixer(pg, seq):
    """transformers' NemotronH Mamba2 mixer (its torch path) computes the same function.

    An independent implementation with HF's parameter names (``conv1d`` an ``nn.Conv1d``);
    ``time_step_min=0`` because megatron-core does not clamp the step size from below (HF's
    default ``time_step_limit`` does), and eps 1e-5 as megatron-core's gated norm.
    """
    nemotron = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

    mixer = _mixer(pg, 2, chunk_size=8)
    _randomise(mixer, seed=13)
    config = NemotronHConfig(
        hidden_size=HIDDEN, mamba_num_heads=mixer.nheads, mamba_head_dim=HEAD_DIM,
        ssm_state_size=STATE, n_groups=2, conv_kernel=mixer.d_conv, chunk_size=8,
        layer_norm_epsilon=1e-5, time_step_min=0.0, num_hidden_layers=1,
        hybrid_override_pattern="M",
    )  # fmt: skip
    hf = nemotron.NemotronHMamba2Mixer(config, layer_idx=0)
    renames = {"conv1d_weight": "conv1d.weight", "conv1d_bias": "conv1d.bias"}
    ours = {renames.get(k, k): v for k, v in mixer.state_dict().items() if "_extra_state" not in k}
    hf.load_state_dict(ours, strict=True)
    hidden = torch.randn(seq, BATCH, HIDDEN, generator=torch.Generator().manual_seed(seq))

    def evaluate(rounding):  # HF's layout is [B, S, H]; the transposes are views, no arithmetic
        with torch.no_grad(), rounding:
            return {"out": hf(hidden.transpose(0, 1)).transpose(0, 1)}

    with torch.no_grad():
        actual = mixer(hidden)[0]
    expected = evaluate(contextlib.nullcontext())["out"]
    over = _over_bound({"out": rel_error(actual, expected)}, _bounds(evaluate))
    assert not over, f"(name, error, bound) over the bound: {over}"


def _megatron_mixer(pg, monkeypatch, groups: int):
    """megatron-core's MambaMixer built on CPU: import check off, the Triton norm replaced."""
    from megatron.core.ssm import mamba_mixer

    from megatron_hybrid.modules.mamba_torch import GatedRMSNorm

    def norm(hidden_size, eps, group_size, norm_before_gate, device, dtype):
        return GatedRMSNorm(hidden_size, group_size, eps, None, device, dtype)

    monkeypatch.setattr(mamba_mixer, "HAVE_MAMBA_SSM", True)
    monkeypatch.setattr(mamba_mixer, "ExtendedRMSNorm", norm)
    return _mixer(pg, groups, cls=mamba_mixer.MambaMixer)


@pytest.mark.parametrize("groups", [1, 2], ids=["g1", "g2"])
def test_same_parameters_and_checkpoint_keys_as_megatron(pg, monkeypatch, groups):
    reference = _megatron_mixer(pg, monkeypatch, groups)
    ours = _mixer(pg, groups)
    theirs = reference.state_dict()
    assert list(ours.state_dict()) == list(theirs)
    for name, tensor in ours.state_dict().items():
        if name.endswith("_extra_state"):  # the linear layers' (empty) extra state
            continue
        assert tensor.dtype == theirs[name].dtype, name
        assert torch.equal(tensor, theirs[name]), f"{name} initialised differently"
    for name, param in ours.named_parameters():
        ref = dict(reference.named_parameters())[name]
        for attr in ("tensor_model_parallel", "partition_dim", "partition_sizes"):
            assert getattr(param, attr, None) == getattr(ref, attr, None), (name, attr)
    # Distributed-checkpoint keys (in_proj split into z/x/B/C/dt, conv1d.weight/bias).
    ours_sharded = ours.sharded_state_dict(prefix="mixer.")
    assert sorted(ours_sharded) == sorted(reference.sharded_state_dict(prefix="mixer."))
    assert {"mixer.conv1d.weight", "mixer.norm.weight", "mixer.A_log"} <= {
        getattr(v, "key", None) for v in ours_sharded.values()
    }


def test_spec_picks_torch_mixer_without_kernels():
    from megatron_hybrid.modules import hybrid_stack_spec
    from megatron_hybrid.modules.mamba_torch import TorchMambaMixer, mamba_kernels_available

    available, reason = mamba_kernels_available()
    assert not available and reason  # a CPU-only machine
    for backend_impl in ("auto", "torch"):
        spec = hybrid_stack_spec("local", mamba_impl=backend_impl)
        assert spec.submodules.mamba_layer.submodules.mixer.module is TorchMambaMixer
        assert spec.metainfo["mamba_impl"] == "torch"


@pytest.mark.parametrize(
    "impl, match",
    [
        pytest.param("kernels", r"mamba_impl='kernels' needs .* or use mamba_impl='auto'",
                     id="kernels-unavailable"),
        pytest.param("triton", r"mamba_impl must be one of \('auto', 'torch', 'kernels'\)",
                     id="unknown"),
    ],
)  # fmt: skip
def test_spec_refuses_bad_mamba_impl(impl, match):
    from megatron_hybrid.modules import hybrid_stack_spec

    with pytest.raises(ValueError, match=match):
        hybrid_stack_spec("local", mamba_impl=impl)


def test_inference_context_is_refused(pg):
    mixer = _mixer(pg, 1)
    with pytest.raises(NotImplementedError, match="keeps no decode state"):
        mixer(torch.zeros(4, 1, HIDDEN), inference_context=object())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param(dict(bias=True), r"bias=True", id="bias"),
        pytest.param(dict(norm_before_gate=True), r"norm_before_gate=True", id="norm-before-gate"),
        pytest.param(dict(chunk_size=0), r"chunk_size 0", id="chunk-size"),
    ],
)
def test_unsupported_options_are_refused(pg, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _mixer(pg, 1, **kwargs)


@pytest.mark.parametrize(
    "groups, config, match",
    [
        pytest.param(3, {}, r"8 Mamba heads do not split into 3 groups", id="groups"),
        pytest.param(2, dict(mamba_head_dim=None), r"mamba_head_dim must be a positive integer",
                     id="no-head-dim"),
        pytest.param(2, dict(mamba_head_dim=5), r"32 is not a multiple of mamba_head_dim 5",
                     id="head-dim"),
        pytest.param(2, dict(mamba_state_dim=0), r"mamba_state_dim must be a positive integer",
                     id="state-dim"),
    ],
)  # fmt: skip
def test_bad_sizes_are_refused(pg, groups, config, match):
    with pytest.raises(ValueError, match=match):
        _mixer(pg, groups, config=config)


def test_mixer_packed_input_equals_separate_sequences(pg):
    """THD input (``PackedSeqParams`` with ``total_tokens``) = each sequence run on its own."""
    from megatron.core.packed_seq_params import PackedSeqParams

    mixer = _mixer(pg, 2, chunk_size=8)
    _randomise(mixer, seed=9)
    cu_seqlens = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, total_tokens=24
    )
    hidden = torch.randn(24, 1, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = mixer(hidden, packed_seq_params=packed)[0]
        alone = [
            mixer(hidden[s:e])[0] for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)
        ]
        unpacked = mixer(hidden)[0]
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-5, atol=1e-6)
    assert rel_error(unpacked[7:], out[7:]) > 1e-2  # the packing changed something

    packed.seq_idx = None
    with pytest.raises(ValueError, match=r"needs packed_seq_params.seq_idx"):
        mixer(hidden, packed_seq_params=packed)


def _tp_shard(name: str, full: torch.Tensor, mixer, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s shard of a TP1 parameter (or gradient) of the mixer."""
    d_inner, gn, heads = mixer.d_inner, mixer.ngroups * mixer.d_state, mixer.nheads
    if name == "out_proj.weight":
        return full.chunk(tp, dim=1)[rank]
    sizes = {
        "in_proj.weight": [d_inner, d_inner, gn, gn, heads],  # z x B C dt, each split over TP
        "conv1d_weight": [d_inner, gn, gn],
        "conv1d_bias": [d_inner, gn, gn],
    }.get(name, [full.shape[0]])
    return torch.cat([part.chunk(tp)[rank] for part in full.split(sizes)])


def _checkpoint_tensors(mixer) -> dict:
    """The mixer's distributed-checkpoint tensors (factories split into their saved parts)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = mixer.sharded_state_dict(prefix="mixer.")
    apply_factories(sharded)
    return {t.key: t for t in nested_values(sharded) if isinstance(t, ShardedTensor)}


def _checkpoint_mismatches(tp_mixer, reference: dict) -> list[str]:
    """Keys whose TP shard is not the slice of the TP1 tensor at its global offset."""
    bad = []
    for key, shard in _checkpoint_tensors(tp_mixer).items():
        full = reference[key]
        region = tuple(
            slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape, strict=True)
        )
        if shard.global_shape != full.global_shape or not torch.equal(
            shard.data, full.data[region]
        ):
            bad.append(key)
    return bad if len(reference) == len(_checkpoint_tensors(tp_mixer)) else ["key sets differ"]


def _tp_errors(rank: int, world_size: int) -> tuple[dict[str, float], dict[str, float]]:
    """TP2 (with and without SP) against TP1 on the same weights: output and every gradient.

    Also the checkpoint layout: every TP2 shard is the slice of the TP1 tensor at its global
    offset (``in_proj``'s z/x/B/C/dt parts, conv parts, the norm weight), so TP1 and TP2
    checkpoints are interchangeable.

    Returns:
        ``(errors, bounds)``: each compared part's relative error, and its float32 bound from
        the TP1 reference's computation.
    """
    from megatron_hybrid.process_groups import (
        initialize_model_parallel,
        reset_megatron_state,
    )

    seq = 12

    def local(sp: bool) -> slice:
        """This rank's tokens: its part of the sequence with SP, else all of them."""
        return (
            slice(rank * seq // world_size, (rank + 1) * seq // world_size) if sp else slice(None)
        )

    def evaluate(reference, hidden, grad_out, groups: int, rounding) -> dict[str, torch.Tensor]:
        """The TP1 reference's results: the parts this rank's TP2 results equal, with and
        without SP (taking the parts is no arithmetic: outside the rounding)."""
        results = _outputs_and_grads(None, reference, hidden, grad_out, rounding)
        parts = {}
        for sp in (False, True):
            for name, value in results.items():
                if name in ("out", "dhidden"):
                    part = value[local(sp)]
                else:
                    part = _tp_shard(name[1:], value, reference, rank, world_size)
                parts[f"g{groups}-sp{int(sp)}-{name}"] = part
        return parts

    errors, bounds = {}, {}
    for groups in (2, 4):
        gen = torch.Generator().manual_seed(groups)
        hidden = torch.randn(seq, BATCH, HIDDEN, generator=gen)
        grad_out = torch.randn(seq, BATCH, HIDDEN, generator=gen)
        reference = _mixer(initialize_model_parallel(tp=1), groups, chunk_size=5)
        _randomise(reference, seed=groups)
        reference_parts = functools.partial(evaluate, reference, hidden, grad_out, groups)
        expected = reference_parts(None)
        bounds |= _bounds(reference_parts)
        params = {name: p.detach().clone() for name, p in reference.named_parameters()}
        reference_checkpoint = _checkpoint_tensors(reference)
        assert len(reference_checkpoint) == 16  # in_proj: 5 parts, conv: 2 x 3, 5 others
        reset_megatron_state()
        for sp in (False, True):
            pg = initialize_model_parallel(tp=world_size)
            config = dict(tensor_model_parallel_size=world_size, sequence_parallel=sp)
            mixer = _mixer(pg, groups, config=config, chunk_size=5)
            with torch.no_grad():
                for name, param in mixer.named_parameters():
                    param.copy_(_tp_shard(name, params[name], reference, rank, world_size))
            actual = _outputs_and_grads(None, mixer, hidden[local(sp)], grad_out[local(sp)])
            for name, value in actual.items():
                key = f"g{groups}-sp{int(sp)}-{name}"
                errors[key] = rel_error(value, expected[key])
            if not sp:
                bad = _checkpoint_mismatches(mixer, reference_checkpoint)
                assert not bad, f"TP{world_size} checkpoint shards differ from TP1: {bad}"
            reset_megatron_state()
    return errors, bounds


def _cp_errors(rank: int, world_size: int) -> tuple[dict[str, float], dict[str, float]]:
    """CP2 (megatron-core's all-to-all: heads split, whole sequence per rank) against CP1.

    Each rank holds sequence chunks ``rank`` and ``2 cp - 1 - rank`` (attention's load
    balancing); gradients of the replicated parameters are summed over CP, as DDP does.

    Returns:
        ``(errors, bounds)``: each compared part's relative error, and its float32 bound from
        the CP1 reference's computation.
    """
    import torch.distributed as dist

    from megatron_hybrid.process_groups import (
        initialize_model_parallel,
        reset_megatron_state,
    )

    errors = {}
    seq, groups = 16, 2
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(seq, BATCH, HIDDEN, generator=gen)
    grad_out = torch.randn(seq, BATCH, HIDDEN, generator=gen)
    size = seq // (2 * world_size)
    chunks = [rank, 2 * world_size - 1 - rank]
    local = torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])
    reference = _mixer(initialize_model_parallel(), groups, chunk_size=5)
    _randomise(reference, seed=7)

    def evaluate(rounding) -> dict[str, torch.Tensor]:
        """The CP1 reference's results: the parts this rank's results (parameter gradients
        summed over CP) equal (taking the parts is no arithmetic: outside the rounding)."""
        results = _outputs_and_grads(None, reference, hidden, grad_out, rounding)
        return {
            f"cp-{name}": value[local] if name in ("out", "dhidden") else value
            for name, value in results.items()
        }

    expected = evaluate(None)
    bounds = _bounds(evaluate)
    params = {name: p.detach().clone() for name, p in reference.named_parameters()}
    reset_megatron_state()

    pg = initialize_model_parallel(cp=world_size)
    mixer = _mixer(pg, groups, config=dict(context_parallel_size=world_size), chunk_size=5)
    with torch.no_grad():
        for name, param in mixer.named_parameters():
            param.copy_(params[name])
    actual = _outputs_and_grads(None, mixer, hidden[local], grad_out[local])
    for name, value in actual.items():
        if name not in ("out", "dhidden"):
            dist.all_reduce(value, group=pg.cp)
        errors[f"cp-{name}"] = rel_error(value, expected[f"cp-{name}"])
    reset_megatron_state()
    return errors, bounds


def _parallel_worker(rank: int, world_size: int) -> tuple[dict[str, float], dict[str, float]]:
    """``(errors, bounds)`` of every TP and CP comparison on this rank."""
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    torch.set_num_threads(1)
    tp_errors, tp_bounds = _tp_errors(rank, world_size)
    cp_errors, cp_bounds = _cp_errors(rank, world_size)
    return {**tp_errors, **cp_errors}, {**tp_bounds, **cp_bounds}


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_and_context_parallel_match_single_rank():
    """TP2 splits heads and B/C groups (each rank norms its own groups), with and without SP;
    CP2 exchanges sequence for heads. Both must compute the single-rank layer."""
    from megatron_hybrid.testing.spawn import run_distributed

    for errors, bounds in run_distributed(_parallel_worker, 2, timeout=300):
        # TP: groups x SP x (output, input, 8 parameters); CP: (output, input, 8 parameters).
        assert len(errors) == 2 * 2 * 10 + 10, sorted(errors)
        over = _over_bound(errors, bounds)
        assert not over, f"(name, error, bound) over the bound: {over}"

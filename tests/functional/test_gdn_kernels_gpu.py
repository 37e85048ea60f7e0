"""GatedDeltaNet's kernels against naive float32 references, forward and gradients, on GPUs.

megatron-core's GatedDeltaNet runs either fla's Triton kernels (``chunk_gated_delta_rule`` and
``causal_conv1d``) or, in ``deterministic_mode``, its own torch path
(``torch_chunk_gated_delta_rule`` and ``F.conv1d``). Both are compared here with the references
of ``support.gdn_reference`` (a step-by-step recurrence and an ``F.conv1d`` in
float32, gradients from torch's autograd) on the inputs the layer passes: bf16 q, k, v, beta and
conv weights, float32 g. The tables give the norm-relative error ``|a - r| / |r|`` of each tensor.

Tolerances are set against a yardstick measured in the same test: megatron's torch path on the
same bf16 inputs, whose only error is rounding its bf16 outputs and gradients (it computes in
float32). fla may lose a few such roundings more (it keeps intermediates in the input dtype), so
it must stay within a small multiple of the yardstick plus a floor; a wrong kernel is off by
O(1) and fails.

fla 0.6.0 refuses its gated backward on Hopper with Triton >= 3.4 and < 3.7.1 (fla issue #640);
the package registers its own kernel for the refused piece there
(``megatron_hybrid.modules.fla_backend``), so the backward is compared on the stock image too.
Where fla still refuses (``MEGATRON_HYBRID_FLA_DQKWG=fla``), only the forward pass is compared and
the table says the backward was refused.

``MH_FUNCTIONAL_ON_CPU=1`` runs the torch-path parts on the CPU; fla's parts need Triton's GPU
driver and are skipped there with the reason in the table. fla runs in bf16 only, as megatron
calls it: on a fresh machine each of its kernels is compiled and autotuned on first use (minutes),
and a float32 variant would double that. Run this file in one process
(``torchrun --nproc_per_node 1``): every rank would compile the same kernels.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable, Collection, Iterator

import pytest
import torch
from conftest import ON_CPU, exact_float32, rel_error, report, require_fla_training
from support.gdn_reference import (
    depthwise_causal_conv1d,
    make_gdn_inputs,
    recurrent_gated_delta_rule,
)

GDN_INPUTS = ("q", "k", "v", "g", "beta")
# The layer computes g in float32 (from A_log and alpha.float()); the rest come in the model dtype.
FLOAT32_ALWAYS = {"g"}
CONV_WIDTH = 4
# (batch, sequence, heads, head dim K = V). "benchmark": the heads of benchmarks/ep_overlap.py's
# GatedDeltaNet layer, T = 1024 (16 chunks of 64); Triton specialises fla's kernels on H, K and V,
# so a benchmark run after this test reuses its compiled and autotuned kernels. "small": what the
# small test models (``small_config``: 2 heads of 16, two sequences of 64 tokens) feed the kernels.
SHAPES = {"benchmark": (1, 1024, 16, 128), "small": (2, 64, 2, 16)}
shapes = pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
FLA_REFUSAL = "#640"
CPU_SKIP = "skipped: Triton kernels need a GPU (no CPU driver)"

# Both are float32 with TF32 off: only summation order differs (measured ~1e-7 on the CPU).
FP32_TOL = 1e-4
# The yardstick itself only rounds bf16 results once (unit roundoff 2^-8 = 3.9e-3, ~1e-3 in a
# norm); more than this means the torch path, not its rounding, is off.
BF16_ROUNDING_TOL = 5e-3
# fla bf16: up to 8 yardsticks (a few more bf16 roundings of intermediates, amplified a little by
# the chunk recurrence) plus a floor for tensors whose yardstick is ~0: dg is float32 in both
# paths, so the torch path's dg carries no rounding, but fla derives it from bf16 products.
GDN_FLA_FACTOR, GDN_FLA_FLOOR = 8.0, 1e-2
# The convolution has no bf16 intermediates in either path (4 taps, float32 accumulation), so fla
# must be within a few yardsticks; the floor covers the bias and weight gradients, reductions
# over B*T that either side may order differently.
CONV_FLA_FACTOR, CONV_FLA_FLOOR = 4.0, 1e-3


@contextlib.contextmanager
def _progress(label: str) -> Iterator[None]:
    """Prints what runs and how long it took: a first fla call compiles and autotunes (minutes)."""
    start = time.perf_counter()
    print(f"\n  {label} ...", end=" ", flush=True)
    try:
        yield
    finally:
        print(f"{time.perf_counter() - start:.1f} s", flush=True)


def _run(
    fn: Callable[..., torch.Tensor | tuple],
    inputs: dict[str, torch.Tensor],
    grad_out: torch.Tensor,
    dtype: torch.dtype,
    keep_float32: Collection[str] = (),
    backward: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """``fn``'s output and its inputs' gradients, or ``None`` where fla refuses the backward
    (or ``backward`` is False: known to be refused, not worth its autotuning)."""
    leaves = {
        name: t.detach().to(torch.float32 if name in keep_float32 else dtype, copy=True)
        for name, t in inputs.items()
    }
    for leaf in leaves.values():
        leaf.requires_grad_()
    out = fn(**leaves)
    if isinstance(out, tuple):  # the kernels return (output, final_state)
        out = out[0]
    if not backward:
        return out.detach(), None
    try:
        out.backward(grad_out.to(out.dtype))
    except RuntimeError as error:  # fla's own refusal (#640), nothing else
        if FLA_REFUSAL not in str(error):
            raise
        return out.detach(), None
    return out.detach(), {name: leaf.grad for name, leaf in leaves.items()}


def _compare(
    label: str,
    result: tuple[torch.Tensor, dict[str, torch.Tensor] | None],
    reference: tuple[torch.Tensor, dict[str, torch.Tensor]],
) -> dict[str, float | None]:
    """Norm-relative error of the output (``"out"``) and of each gradient (``None``: refused)."""
    (out, grads), (ref_out, ref_grads) = result, reference
    assert out.shape == ref_out.shape, (label, out.shape)
    errors: dict[str, float | None] = {"out": rel_error(out, ref_out)}
    for name, ref_grad in ref_grads.items():
        errors[f"d{name}"] = None if grads is None else rel_error(grads[name], ref_grad)
    return errors


def _measure(
    kernels: tuple,
    inputs: dict[str, torch.Tensor],
    grad_out: torch.Tensor,
    reference: tuple[torch.Tensor, dict[str, torch.Tensor]],
    keep_float32: Collection[str] = (),
    fla_refuses: str | None = None,
) -> tuple[dict[str, dict], dict[str, str]]:
    """Errors of each ``(label, fn, dtype)`` kernel against the reference, and notes per label.

    fla's kernels need Triton's GPU driver: on the CPU they are skipped with a note.
    ``fla_refuses``: why fla would refuse the backward here; then fla runs forward only (its
    refusal comes after a minute of backward autotuning).
    """
    errors, notes = {}, {}
    for label, fn, dtype in kernels:
        if label.startswith("fla") and ON_CPU:
            notes[label] = CPU_SKIP
            continue
        refused = label.startswith("fla") and fla_refuses is not None
        with _progress(label):
            result = _run(fn, inputs, grad_out, dtype, keep_float32, backward=not refused)
        errors[label] = _compare(label, result, reference)
        if result[1] is None:
            notes[label] = f"backward refused by fla: {fla_refuses or '#640'}"
    return errors, notes


def _table(
    first: str, errors: dict[str, dict], notes: dict[str, str], bound: Callable[[str], float]
) -> list[tuple]:
    """Header, one row per kernel in run order (errors, then its note), and the fla bound."""
    names = list(next(iter(errors.values())))
    rows = [(first, *names, "note")]
    for label in dict.fromkeys([*errors, *notes]):
        cells = ["-" if e is None else f"{e:.2e}" for e in errors.get(label, {}).values()]
        rows.append((label, *cells, notes.get(label, "")))
    return rows + [("fla bound", *(f"{bound(n):.2e}" for n in names))]


def _failures(
    label: str, errors: dict[str, float | None], bound: Callable[[str], float]
) -> list[str]:
    return [
        f"{label} {name}: {e:.2e} > {bound(name):.2e}"
        for name, e in errors.items()
        if e is not None and not e <= bound(name)  # `not <=` also fails NaN
    ]


def _fla_refuses() -> str | None:
    """Why fla would refuse the gated backward on this GPU (Triton < 3.7.1 on Hopper), or None."""
    if ON_CPU:
        return None
    from megatron_hybrid.training.capabilities import fla_gated_backward_refused

    return fla_gated_backward_refused()


def _fla_versions() -> str:
    import fla
    import triton

    # fla dispatches to FlashQLA (TileLang) when that package is there, and parts of the
    # backward to TileLang kernels: say which code ran.
    from megatron_hybrid.modules.fla_backend import dqkwg_choice

    extra = [p for p in ("flash_qla", "tilelang") if importlib.util.find_spec(p) is not None]
    choice, why = dqkwg_choice()
    return (
        f"fla {fla.__version__}, Triton {triton.__version__}, "
        f"{torch.cuda.get_device_name()}, optional backends: {', '.join(extra) or 'none'}; "
        f"dq/dk/dw/dg kernel: {choice} ({why})"
    )


@pytest.mark.time_limit(240)  # fla compiles its kernels on first use
@shapes
def test_chunk_gated_delta_rule_matches_recurrent_reference(world, shape):
    """fla's ``chunk_gated_delta_rule`` and megatron's torch path vs the naive recurrence."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    *_, device = world
    if not ON_CPU:
        pytest.importorskip("fla")
    batch, seq, heads, head_dim = shape
    # Every kernel gets the same values: round to bf16 first, so the reference sees the bf16
    # paths' actual inputs and input rounding is no one's error.
    inputs = make_gdn_inputs(batch, seq, heads, head_dim, head_dim, seed=11, device=device)
    inputs = {
        name: t if name in FLOAT32_ALWAYS else t.bfloat16().float() for name, t in inputs.items()
    }
    gen = torch.Generator().manual_seed(12)
    grad_out = torch.randn(batch, seq, heads, head_dim, generator=gen).bfloat16().float()
    grad_out = grad_out.to(device)

    # As megatron's GatedDeltaNet calls either kernel (it l2-normalises q and k itself).
    call = dict(initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False)

    def megatron_torch(**tensors):
        return torch_chunk_gated_delta_rule(**tensors, **call)

    def fla_chunk(**tensors):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        from megatron_hybrid.modules.fla_backend import register_fla_backend

        register_fla_backend()  # as GatedDeltaNet does: fla's #640 kernel replaced where refused
        return chunk_gated_delta_rule(**tensors, **call)

    with exact_float32():
        with _progress("recurrent reference fp32"):
            reference = _run(recurrent_gated_delta_rule, inputs, grad_out, torch.float32)
        kernels = (
            ("megatron torch fp32", megatron_torch, torch.float32),
            ("megatron torch bf16", megatron_torch, torch.bfloat16),
            ("fla bf16", fla_chunk, torch.bfloat16),
        )
        errors, notes = _measure(
            kernels, inputs, grad_out, reference, FLOAT32_ALWAYS, fla_refuses=_fla_refuses()
        )

    yardstick = errors["megatron torch bf16"]

    def fla_bound(name: str) -> float:
        # Capped, so that a broken yardstick (failed below) cannot wave fla through.
        return GDN_FLA_FACTOR * min(yardstick[name], BF16_ROUNDING_TOL) + GDN_FLA_FLOOR

    rows = _table("kernel (fla bound: 8 x torch bf16 + 1e-2)", errors, notes, fla_bound)
    if not ON_CPU:
        rows.append((_fla_versions(),))
    report(f"chunk_gated_delta_rule vs recurrence, B{batch} T{seq} H{heads} K=V{head_dim}", rows)

    failures = _failures("megatron torch fp32", errors["megatron torch fp32"], lambda _: FP32_TOL)
    failures += _failures("megatron torch bf16", yardstick, lambda _: BF16_ROUNDING_TOL)
    failures += _failures("fla bf16", errors.get("fla bf16", {}), fla_bound)
    assert not failures, failures
    if any(label in notes and "refused" in notes[label] for label in errors):
        # Only the forward pass could be compared: say so rather than pass.
        pytest.skip(f"forward compared, gradients not: {_fla_refuses() or 'fla #640'}")


@pytest.mark.time_limit(180)
@shapes
def test_causal_conv1d_matches_reference(world, shape):
    """fla's ``causal_conv1d`` and ``F.conv1d`` (megatron's two conv paths) vs float32."""
    *_, device = world
    if not ON_CPU:
        pytest.importorskip("fla")
    batch, seq, heads, head_dim = shape
    channels = heads * head_dim * 3  # q, k and v go through one convolution
    gen = torch.Generator().manual_seed(13)
    # nn.Conv1d's default init for a depthwise filter of width 4 is U(-1/2, 1/2).
    inputs = dict(
        x=torch.randn(batch, seq, channels, generator=gen),
        weight=torch.rand(channels, CONV_WIDTH, generator=gen) - 0.5,
        bias=0.1 * torch.randn(channels, generator=gen),
    )
    inputs = {name: t.bfloat16().float().to(device) for name, t in inputs.items()}
    grad_out = torch.randn(batch, seq, channels, generator=gen).bfloat16().float().to(device)

    def torch_conv(x, weight, bias):
        return depthwise_causal_conv1d(x, weight, bias, activation="silu")

    def fla_conv(x, weight, bias):
        from fla.modules.convolution import causal_conv1d

        # As megatron's gdn.py calls it, weight [D, 1, W] squeezed to [D, W].
        return causal_conv1d(
            x=x, weight=weight, bias=bias, activation="silu", initial_state=None,
            output_final_state=False, cu_seqlens=None,
        )  # fmt: skip

    def fla_conv_strided(x, weight, bias):
        # In the layer, x is a slice of the input projection's [S, B, *] output, transposed to
        # [B, S, *]: not contiguous, time stride larger than D. Same values, that layout.
        wide = torch.cat([x.transpose(0, 1), x.new_zeros(seq, batch, 64)], dim=-1)
        return fla_conv(wide.transpose(0, 1)[..., :channels], weight, bias)

    with exact_float32():
        reference = _run(torch_conv, inputs, grad_out, torch.float32)
        kernels = (
            ("F.conv1d fp32", torch_conv, torch.float32),
            ("F.conv1d bf16", torch_conv, torch.bfloat16),
            ("fla bf16", fla_conv, torch.bfloat16),
            ("fla bf16 strided x", fla_conv_strided, torch.bfloat16),
        )
        errors, notes = _measure(kernels, inputs, grad_out, reference)

    yardstick = errors["F.conv1d bf16"]

    def fla_bound(name: str) -> float:
        return CONV_FLA_FACTOR * min(yardstick[name], BF16_ROUNDING_TOL) + CONV_FLA_FLOOR

    rows = _table("conv (fla bound: 4 x F.conv1d bf16 + 1e-3)", errors, notes, fla_bound)
    dims = f"B{batch} T{seq} D{channels} W{CONV_WIDTH}"
    report(f"causal_conv1d (silu) vs F.conv1d fp32, {dims}", rows)

    # The reference is F.conv1d fp32 itself: that row is a determinism check, 0 expected.
    failures = _failures("F.conv1d fp32", errors["F.conv1d fp32"], lambda _: FP32_TOL)
    failures += _failures("F.conv1d bf16", yardstick, lambda _: BF16_ROUNDING_TOL)
    for label in ("fla bf16", "fla bf16 strided x"):
        failures += _failures(label, errors.get(label, {}), fla_bound)
    assert not failures, failures


@pytest.mark.time_limit(240)  # fla compiles its varlen kernels on first use
def test_fla_kernels_get_chunk_indices_without_host_syncs(world):
    """fla's conv and rule as ``HybridGatedDeltaNet`` calls them (``_with_chunk_indices``) on a
    packed batch moved from the host: no host synchronisation (torch's sync debug mode raises on
    any), chunk indices equal to fla's own, outputs equal to fla's unwrapped call bit for bit;
    the control runs fla unwrapped under the same mode and must meet its synchronisation."""
    _, _, device = world
    if device.type != "cuda":
        pytest.skip("fla's Triton kernels and host synchronisations exist on CUDA only")
    pytest.importorskip("fla")
    from fla.modules.convolution import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.utils.index import prepare_chunk_indices

    from megatron_hybrid.modules.gated_delta_net import _with_chunk_indices, fla_chunk_indices
    from megatron_hybrid.padding.batch import to_device

    torch.manual_seed(0)
    heads, dim, width = 2, 64, CONV_WIDTH
    host = torch.tensor([0, 100, 100, 357, 1024], dtype=torch.int32)  # an empty sequence too
    total = int(host[-1])
    x = torch.randn(1, total, heads * dim, device=device, dtype=torch.bfloat16)
    weight = torch.randn(heads * dim, width, device=device, dtype=torch.bfloat16) / width
    q, k, v = (torch.nn.functional.normalize(torch.randn(1, total, heads, dim, device=device),
                                             dim=-1).bfloat16() for _ in range(3))  # fmt: skip
    g = -torch.rand(1, total, heads, device=device)
    beta = torch.rand(1, total, heads, device=device).bfloat16()
    conv, rule = _with_chunk_indices(causal_conv1d), _with_chunk_indices(chunk_gated_delta_rule)

    def both(conv_fn, rule_fn, cu_seqlens):
        y, _ = conv_fn(x=x, weight=weight, bias=None, activation="silu", cu_seqlens=cu_seqlens)
        o, _ = rule_fn(q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens)
        return y, o

    with _progress("fla varlen conv and rule (compiles on first use)"):
        want = both(causal_conv1d, chunk_gated_delta_rule, host.to(device))
    torch.cuda.synchronize()
    cu_seqlens = to_device(host, device)  # a fresh batch: nothing of it cached by fla or us
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = both(conv, rule, cu_seqlens)
        with pytest.raises(RuntimeError, match="synchroniz"):  # control: fla's own indices
            both(causal_conv1d, chunk_gated_delta_rule, to_device(host, device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ours, fla_own = fla_chunk_indices(cu_seqlens), prepare_chunk_indices(cu_seqlens, 64)
    report("fla chunk indices from the host", [
        ("chunks", "ours == fla's", "conv output bitwise", "rule output bitwise"),
        (len(ours), torch.equal(ours, fla_own), torch.equal(got[0], want[0]),
         torch.equal(got[1], want[1]))])  # fmt: skip
    assert ours.dtype == fla_own.dtype and torch.equal(ours, fla_own)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.time_limit(240)  # fla compiles its grouped variants on first use
def test_layer_hands_fla_s_rule_its_key_heads(world, monkeypatch):
    """``HybridGatedDeltaNet`` with 2 query/key heads shared by 4 value heads, on a packed batch,
    through fla's conv and rule: the rule gets the key heads as they are (fla shares them among
    the value heads itself). Against megatron's preparation, which repeats them to one per value
    head: the forward is the same arithmetic (bit for bit); the gradients differ in where the
    group's ``dq`` / ``dk`` are summed and rounded to bf16, so each must be as close to a float32
    run of megatron's way as megatron's own bf16 run is, within twice that plus a floor (the
    float32 run takes the package's torch stand-ins of fla's three functions, which compute the
    same functions without compiling fla's float32 variants)
    (``A_log`` and ``dt_bias`` take fla's ``dg``, whose atomic adds vary from run to run:
    ``test_gdn_gates_gpu.py`` judges them). The control shares the heads in the tiled order,
    which must change the output."""
    from support.gdn_layer import (
        KEY_HEADS,
        VALUE_HEADS,
        build_gated_delta_net,
        layer_step,
        packed_params,
        tiled,
    )

    _, _, device = world
    require_fla_training(device)
    from megatron.core.ssm.gated_delta_net import common as megatron_gdn_common
    from megatron.core.ssm.gated_delta_net import gdn as megatron_gdn

    from megatron_hybrid.modules import gdn_torch
    from megatron_hybrid.process_groups import initialize_model_parallel, reset_megatron_state

    lengths = (3, 70, 1, 64, 29)
    pg = initialize_model_parallel(seed=1)
    try:
        runs, weights = {}, None
        for dtype in (torch.bfloat16, torch.float32):
            torch.manual_seed(3)
            layer = build_gated_delta_net(
                pg, deterministic_mode=False, linear_num_key_heads=KEY_HEADS,
                linear_num_value_heads=VALUE_HEADS, params_dtype=dtype,
                bf16=dtype == torch.bfloat16,
            ).to(device)  # fmt: skip
            assert layer.rule_takes_key_heads
            if weights is None:  # the float32 layer gets the bf16 layer's weights
                weights = {k: v.float() for k, v in layer.state_dict().items() if v is not None}
            else:
                layer.load_state_dict(weights, strict=False)  # the linears' empty _extra_state
                monkeypatch.setattr(megatron_gdn, "causal_conv1d", gdn_torch.causal_conv1d)
                monkeypatch.setattr(megatron_gdn_common, "l2norm", gdn_torch.l2norm)
                layer.gated_delta_rule = gdn_torch.chunk_gated_delta_rule
            gen = torch.Generator().manual_seed(4)
            hidden = torch.randn(sum(lengths), 1, layer.config.hidden_size, generator=gen)
            hidden = hidden.to(device, dtype)
            params = packed_params(lengths, device)
            with exact_float32():
                if dtype == torch.bfloat16:
                    with _progress("grouped bf16 (fla compiles)"):
                        runs["grouped"] = layer_step(layer, hidden, params)
                    rule = layer.gated_delta_rule
                    layer.gated_delta_rule = tiled(rule)
                    runs["tiled"] = layer_step(layer, hidden, params)
                    layer.gated_delta_rule = rule
                layer.rule_takes_key_heads = False
                label = "repeated" if dtype == torch.bfloat16 else "float32"
                with _progress(f"{label} (megatron's preparation)"):
                    runs[label] = layer_step(layer, hidden, params)
    finally:
        reset_megatron_state()
    yardstick, gated = runs["float32"], ("A_log", "dt_bias")
    rows, failures = [("tensor", "grouped", "repeated", "bound")], []
    for name, want in yardstick.items():
        ours, theirs = (
            rel_error(runs[k][name].float(), want.float()) for k in ("grouped", "repeated")
        )
        bound = 2 * theirs + 1e-2
        rows.append(
            (name, f"{ours:.2e}", f"{theirs:.2e}", "fla's dg" if name in gated else f"{bound:.2e}")
        )
        if name not in gated and ours > bound:
            failures.append((name, ours, bound))
    control = rel_error(runs["tiled"]["out"].float(), runs["grouped"]["out"].float())
    rows.append(("tiled-order control: out", f"{control:.2e}", "", "> 1.00e-02"))
    report(f"key heads {KEY_HEADS} shared by {VALUE_HEADS} value heads, errors vs float32", rows)
    assert torch.equal(runs["grouped"]["out"], runs["repeated"]["out"])
    assert not failures, failures
    assert control > 1e-2

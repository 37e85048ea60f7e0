"""The CPU stand-ins of fla's GatedDeltaNet kernels against the naive references, packed rows too.

A packed row with ``cu_seqlens`` must give every sequence what the step-by-step recurrence and
the plain causal convolution (``support.gdn_reference``) give that sequence alone,
forward and gradients; the same row without ``cu_seqlens`` (state and window running through) is
the negative control.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from support.gdn_layer import (
    KEY_HEADS,
    VALUE_HEADS,
    build_gated_delta_net,
    layer_step,
    packed_params,
    tiled,
)
from support.gdn_reference import (
    depthwise_causal_conv1d,
    make_gdn_inputs,
    recurrent_gated_delta_rule,
)

from megatron_hybrid.modules import gdn_torch
from megatron_hybrid.testing.overlap import rel_error

LENGTHS = (3, 70, 1, 64, 29)  # partial, two and exactly one chunk of 64, a single step
NAMES = ("q", "k", "v", "g", "beta")


def _row(seed: int = 0):
    inputs = make_gdn_inputs(1, sum(LENGTHS), 2, 8, 16, seed=seed)
    bounds = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return inputs, bounds


def _run(fn, inputs, grad_out):
    leaves = {n: inputs[n].clone().requires_grad_() for n in NAMES}
    out = fn(**leaves)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_out)
    return [out.detach(), *(leaves[n].grad for n in NAMES)]


def _per_sequence_reference(bounds):
    def reference(**t):
        parts = [
            recurrent_gated_delta_rule(**{n: x[:, a:b] for n, x in t.items()})
            for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
        ]
        return torch.cat(parts, dim=1)

    return reference


def test_packed_rule_equals_each_sequence_alone():
    inputs, bounds = _row()
    grad_out = torch.randn(1, sum(LENGTHS), 2, 16, generator=torch.Generator().manual_seed(1))
    want = _run(_per_sequence_reference(bounds), inputs, grad_out)

    def packed(**t):
        return gdn_torch.chunk_gated_delta_rule(**t, cu_seqlens=bounds)

    got = _run(packed, inputs, grad_out)
    errors = [rel_error(a, b) for a, b in zip(got, want, strict=True)]
    assert max(errors) < 1e-5, errors
    # Negative control: the state runs from one sequence into the next.
    leaked = _run(gdn_torch.chunk_gated_delta_rule, inputs, grad_out)
    assert rel_error(leaked[0], want[0]) > 1e-2


def test_packed_rule_keeps_one_state_per_sequence():
    inputs, bounds = _row(seed=2)
    states = torch.randn(len(LENGTHS), 2, 8, 16, generator=torch.Generator().manual_seed(3))
    out, finals = gdn_torch.chunk_gated_delta_rule(
        **inputs, initial_state=states, output_final_state=True, cu_seqlens=bounds
    )
    a, b = bounds[3].item(), bounds[4].item()
    alone, final = gdn_torch.chunk_gated_delta_rule(
        **{n: x[:, a:b] for n, x in inputs.items()},
        initial_state=states[3:4],
        output_final_state=True,
    )
    torch.testing.assert_close(out[:, a:b], alone)
    torch.testing.assert_close(finals[3:4], final)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_packed_conv_equals_each_sequence_alone(bias):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, sum(LENGTHS), 6, generator=gen, requires_grad=True)
    weight = torch.randn(6, 4, generator=gen)
    b = torch.randn(6, generator=gen) if bias else None
    _, bounds = _row()
    y, state = gdn_torch.causal_conv1d(x, weight, b, activation="silu", cu_seqlens=bounds)
    assert state is None
    spans = zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
    want = torch.cat(
        [depthwise_causal_conv1d(x[:, i:j], weight, b, activation="silu") for i, j in spans], 1
    )
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    leaked, _ = gdn_torch.causal_conv1d(x, weight, b, activation="silu")
    assert (leaked - want).abs().max() > 1e-2  # the window reaches into the previous sequence


def test_l2norm_is_fla_s():
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16)
    y = gdn_torch.l2norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), torch.nn.functional.normalize(x.float(), dim=-1),
                               rtol=1e-2, atol=1e-2)  # fmt: skip


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, w, c: gdn_torch.causal_conv1d(x.expand(2, -1, -1), w, cu_seqlens=c), "one row"),
        (lambda x, w, c: gdn_torch.causal_conv1d(x, w, cu_seqlens=c[:-1]), "rise from 0 to"),
        (lambda x, w, c: gdn_torch.causal_conv1d(x, w, residual=x), "no residual"),
        (lambda x, w, c: gdn_torch.causal_conv1d(x, w, activation="relu"), "activation"),
        (lambda x, w, c: gdn_torch.causal_conv1d(x, w[:3]), r"weight \[D, W\]"),
    ],
    ids=["batch", "bounds", "residual", "activation", "weight"],
)
def test_conv_refuses_what_it_cannot_do(call, match):
    x, weight = torch.randn(1, 10, 6), torch.randn(6, 4)
    with pytest.raises(ValueError, match=match):
        call(x, weight, torch.tensor([0, 4, 10]))


def test_rule_refuses_unknown_kernel_options():
    inputs, bounds = _row()
    with pytest.raises(ValueError, match="has no"):
        gdn_torch.chunk_gated_delta_rule(**inputs, cu_seqlens=bounds, use_gate_in_kernel=True)


@pytest.mark.parametrize(
    ("offsets", "total", "cp", "error"),
    [
        ([0, 4, 10, 16], 16, 1, None),
        ([0, 4, 10, 16], 16, 2, None),
        ([0, 4, 10, 16], 15, 1, "does not match total_sequence_length=15"),
        ([0, 3, 10, 16], 16, 2, r"divisible by cp_size=2, but got lengths: \[3, 7, 6\]"),
    ],
    ids=["ok", "ok-cp2", "total", "cp2-odd"],
)
def test_packed_boundary_checks_are_megatrons_on_the_host(offsets, total, cp, error):
    """HybridGatedDeltaNet reads the boundaries once on the host and decides as megatron-core's
    ``_GDNBase._resolve_cu_seqlens`` does (the same tensor back, the same errors)."""
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    from megatron_hybrid.modules.gated_delta_net import HybridGatedDeltaNet

    padded = torch.tensor(offsets, dtype=torch.int32)
    for method in (_GDNBase._resolve_cu_seqlens, HybridGatedDeltaNet._resolve_cu_seqlens):
        if error is None:
            assert method(None, padded, None, total, "cu_seqlens_q", cp_size=cp) is padded
        else:
            with pytest.raises(ValueError, match=error):
                method(None, padded, None, total, "cu_seqlens_q", cp_size=cp)


def _floor_chunk_indices(offsets: list[int], chunk_size: int) -> torch.Tensor:
    """A deliberate bug for the control: a sequence's last, partial chunk left out."""
    rows = [(s, c) for s, (a, b) in enumerate(pairwise(offsets))
            for c in range((b - a) // chunk_size)]  # fmt: skip
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize(
    ("offsets", "chunk_size"),
    [
        ([0, 100, 100, 357, 1024], 64),
        ([0, 64, 128], 64),
        ([0, 1, 65, 129, 130], 64),
        ([0, 3, 70, 71, 135, 164], 16),
        ([0], 64),
    ],
    ids=["empty-sequence", "whole-chunks", "single-steps", "chunk16", "no-sequence"],
)
def test_chunk_indices_are_fla_s(offsets, chunk_size, dtype):
    """``fla_chunk_indices`` (made on the host, kept per tensor) equals fla 0.6.0's
    ``prepare_chunk_indices`` (made on the tensor's device); the control drops partial chunks."""
    fla_index = pytest.importorskip("fla.ops.utils.index")

    from megatron_hybrid.modules.gated_delta_net import fla_chunk_indices

    cu_seqlens = torch.tensor(offsets, dtype=dtype)
    ours = fla_chunk_indices(cu_seqlens, chunk_size)
    want = fla_index.prepare_chunk_indices(cu_seqlens, chunk_size)
    assert ours.dtype == want.dtype == dtype and ours.shape == want.shape
    assert torch.equal(ours, want)
    assert fla_chunk_indices(cu_seqlens, chunk_size) is ours  # once per tensor and chunk size
    if any((b - a) % chunk_size for a, b in pairwise(offsets)):
        wrong = _floor_chunk_indices(offsets, chunk_size)
        assert wrong.shape != want.shape or not torch.equal(wrong.to(dtype), want)


class _GpuBoundaries:
    """Stands in for GPU ``cu_seqlens`` (the wrapper asks only ``is_cuda``)."""

    is_cuda = True


@pytest.mark.parametrize(
    ("cu_seqlens", "options", "added"),
    [
        (_GpuBoundaries(), {}, True),
        (_GpuBoundaries(), {"chunk_size": 64}, True),
        (torch.tensor([0, 5]), {}, False),
        (None, {}, False),
        (_GpuBoundaries(), {"chunk_indices": "given"}, False),
        (_GpuBoundaries(), {"chunk_size": 32}, False),
        (_GpuBoundaries(), {"cp_context": object()}, False),
    ],
    ids=["gpu", "gpu-chunk64", "host", "none", "given", "chunk32", "cp-context"],
)
def test_chunk_indices_reach_fla_only_where_they_are_fla_s(monkeypatch, cu_seqlens, options, added):
    """The wrapper around fla's kernels adds ``chunk_indices`` only for GPU boundaries, fla's
    chunk size and no ``cp_context`` (fla then reads other boundaries), keeps a caller's own,
    and wraps once."""
    from megatron_hybrid.modules import gated_delta_net

    monkeypatch.setattr(gated_delta_net, "fla_chunk_indices", lambda cu: "ours")
    seen = []

    def kernel(x, *, cu_seqlens=None, **kwargs):
        seen.append(kwargs.get("chunk_indices"))
        return x

    wrapped = gated_delta_net._with_chunk_indices(kernel)
    assert gated_delta_net._with_chunk_indices(wrapped) is wrapped
    assert wrapped(1, cu_seqlens=cu_seqlens, **options) == 1
    want = "ours" if added else options.get("chunk_indices")
    assert seen == [want]


@pytest.mark.parametrize("deterministic", [False, True], ids=["fla", "deterministic"])
def test_gated_delta_net_hands_fla_s_kernels_the_indices(pg, monkeypatch, deterministic):
    """Built where fla's kernels run (a GPU, no ``deterministic_mode``), the layer's rule and
    megatron's module-level conv are the wrapped ones; in ``deterministic_mode`` neither is."""
    import megatron.core.ssm.gated_delta_net.gdn as megatron_gdn

    from megatron_hybrid.modules import gated_delta_net

    conv, rule = megatron_gdn.causal_conv1d, megatron_gdn.chunk_gated_delta_rule
    monkeypatch.setattr(megatron_gdn, "causal_conv1d", conv)  # restored after the test
    monkeypatch.setattr(gated_delta_net.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gated_delta_net, "register_fla_backend", lambda: True)
    layer = build_gated_delta_net(pg, deterministic_mode=deterministic)
    wrapped = not deterministic
    assert getattr(megatron_gdn.causal_conv1d, "_mh_chunk_indices", False) == wrapped
    assert getattr(layer.gated_delta_rule, "_mh_chunk_indices", False) == wrapped
    if wrapped:
        assert megatron_gdn.causal_conv1d.__wrapped__ is conv
        assert layer.gated_delta_rule.__wrapped__ is rule


# ---------------------------------------------------------------------------------------------
# Grouped value heads: HV value heads sharing H query/key heads, as fla's rule takes them
# ---------------------------------------------------------------------------------------------


def _grouped_reference(bounds, key_head_of):
    """Each value head ``i`` of each sequence through the step-by-step recurrence with query/key
    head ``key_head_of(i)``: fla's grouped value heads written out head by head."""

    def reference(q, k, v, g, beta):
        heads = []
        for i in range(v.shape[2]):
            j = key_head_of(i)
            per_head = {"q": q[:, :, j : j + 1], "k": k[:, :, j : j + 1], "v": v[:, :, i : i + 1],
                        "g": g[:, :, i : i + 1], "beta": beta[:, :, i : i + 1]}  # fmt: skip
            heads.append(_per_sequence_reference(bounds)(**per_head))
        return torch.cat(heads, dim=2)

    return reference


def test_rule_shares_key_heads_among_value_heads_as_fla_does():
    """fla 0.6.0's kernels give value head ``i`` query/key head ``i // (HV // H)``; the stand-in
    (which the CPU runtime puts in fla's place) must compute the same, packed, with gradients
    summed over each key head's group. The control is the other order a grouping could take
    (``i % H``, what ``Tensor.repeat`` would make), which must not match."""
    inputs = make_gdn_inputs(1, sum(LENGTHS), VALUE_HEADS, 8, 16, seed=5)
    inputs["q"], inputs["k"] = inputs["q"][:, :, :KEY_HEADS], inputs["k"][:, :, :KEY_HEADS]
    bounds = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    grad_out = torch.randn(1, sum(LENGTHS), VALUE_HEADS, 16,
                           generator=torch.Generator().manual_seed(6))  # fmt: skip
    group = VALUE_HEADS // KEY_HEADS
    want = _run(_grouped_reference(bounds, lambda i: i // group), inputs, grad_out)

    def packed(**t):
        return gdn_torch.chunk_gated_delta_rule(**t, cu_seqlens=bounds)

    got = _run(packed, inputs, grad_out)
    assert [t.shape for t in got[1:3]] == [inputs["q"].shape] * 2
    errors = [rel_error(a, b) for a, b in zip(got, want, strict=True)]
    assert max(errors) < 1e-5, errors
    tiled = _run(_grouped_reference(bounds, lambda i: i % KEY_HEADS), inputs, grad_out)
    assert rel_error(got[0], tiled[0]) > 1e-2


def test_rule_refuses_value_heads_that_do_not_group():
    inputs = make_gdn_inputs(1, 8, 3, 8, 8)
    inputs["q"], inputs["k"] = inputs["q"][:, :, :2], inputs["k"][:, :, :2]
    with pytest.raises(ValueError, match="3 value heads do not share 2 query/key heads evenly"):
        gdn_torch.chunk_gated_delta_rule(**inputs)


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "thd"])
@pytest.mark.parametrize("layer_class", ["hybrid", "fast"])
def test_gated_delta_net_hands_the_rule_its_key_heads(pg, packed, layer_class):
    """Where the layer's rule is fla's (here the CPU runtime's stand-in), the rule gets the
    ``H`` query/key heads and shares them itself: the output and every gradient equal
    megatron's preparation, which repeats them to one per value head, exactly. The control:
    a rule that groups the heads in the other order changes the output, so the equality is not
    one the head order cannot break."""
    from megatron_hybrid.modules.fast.gdn import FastGatedDeltaNet

    cls = FastGatedDeltaNet if layer_class == "fast" else None
    heads = dict(linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS)
    torch.manual_seed(3)
    layer = build_gated_delta_net(pg, cls, deterministic_mode=False, **heads)
    assert layer.rule_takes_key_heads
    seen = []
    rule = layer.gated_delta_rule

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[2], k.shape[2], v.shape[2]))
        return rule(q, k, v, **kwargs)

    layer.gated_delta_rule = spy
    seq, batch = (sum(LENGTHS), 1) if packed else (40, 2)
    hidden = torch.randn(seq, batch, layer.config.hidden_size,
                         generator=torch.Generator().manual_seed(4))  # fmt: skip
    params = packed_params(LENGTHS) if packed else None
    grouped = layer_step(layer, hidden, params)
    assert seen == [(KEY_HEADS, KEY_HEADS, VALUE_HEADS)]
    layer.rule_takes_key_heads = False  # megatron's preparation: one key head per value head
    repeated = layer_step(layer, hidden, params)
    assert seen[1] == (VALUE_HEADS, VALUE_HEADS, VALUE_HEADS)
    for name, value in grouped.items():
        torch.testing.assert_close(value, repeated[name], rtol=0, atol=0, msg=name)
    layer.gated_delta_rule, layer.rule_takes_key_heads = tiled(rule), True
    assert rel_error(layer_step(layer, hidden, params)["out"], grouped["out"]) > 1e-2


def test_torch_paths_get_one_key_head_per_value_head(pg):
    """The torch rules of ``deterministic_mode`` (megatron's loop, the package's scan) take one
    query/key head per value head, so the layer keeps megatron's repetition for them."""
    from megatron_hybrid.modules.fast.gdn import FastGatedDeltaNet

    heads = dict(linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS)
    for cls in (None, FastGatedDeltaNet):
        layer = build_gated_delta_net(pg, cls, deterministic_mode=True, **heads)
        assert not layer.rule_takes_key_heads

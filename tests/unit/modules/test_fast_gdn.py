"""The parallel-scan gated delta rule against megatron's torch loop and the recurrent reference.

float32 on the CPU: forward and the gradients of q, k, v, g and beta, for one partial chunk,
exactly one chunk, chunk counts that are and are not powers of two (the scan's levels), an
initial state, the final state, and the in-kernel l2 norm, each result within the float32
rounding scale of its reference (``rounding.bounds_of``), at least :data:`TOL`. Negative control:
the scan with its states shifted by one chunk (inclusive instead of exclusive) is caught.
"""

from __future__ import annotations

import functools

import pytest
import torch
from rounding import bounds_of, outside
from support.gdn_reference import make_gdn_inputs, recurrent_gated_delta_rule

from megatron_hybrid.testing.overlap import rel_error

NAMES = ("q", "k", "v", "g", "beta")
#: The least relative error allowed (float32 on both sides, about 1e-7 apart at these sizes);
#: each result's bound is its reference's float32 rounding scale where that is larger.
TOL = 1e-5


def _forward_backward(fn, inputs, grad_out, **kwargs):
    leaves = {name: inputs[name].detach().clone().requires_grad_() for name in NAMES}
    extra = {k: v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor) else v
             for k, v in kwargs.items()}  # fmt: skip
    out, final = fn(**leaves, **extra)
    loss = (out * grad_out).sum()
    if final is not None:
        loss = loss + final.square().sum()
    loss.backward()
    grads = {f"d{name}": leaves[name].grad for name in NAMES}
    if isinstance(extra.get("initial_state"), torch.Tensor):
        grads["dinitial_state"] = extra["initial_state"].grad
    return {"o": out.detach(), **({"final": final.detach()} if final is not None else {}), **grads}


def _check(fn, reference, inputs, grad_out, **kwargs) -> dict[str, float]:
    """``fn`` against ``reference`` (forward and gradients), each result within the bound of
    the reference's float32 rounding; returns the relative errors."""
    expected = _forward_backward(reference, inputs, grad_out, **kwargs)
    got = _forward_backward(fn, inputs, grad_out, **kwargs)
    compute = functools.partial(_forward_backward, reference, inputs, grad_out, **kwargs)
    bounds = bounds_of(compute, measure=rel_error, floor=TOL)
    over = outside(got, expected, bounds, rel_error)
    assert not over, over
    return {name: rel_error(got[name], value) for name, value in expected.items()}


@pytest.mark.parametrize(
    "seq, chunk",
    [(50, 64), (64, 64), (130, 64), (40, 8), (56, 8)],
    ids=["one-partial-chunk", "one-chunk", "3-chunks", "5-chunks", "7-chunks"],
)
@pytest.mark.parametrize("value_dim", [16, 24], ids=["V16", "V24"])
def test_scan_matches_megatron_torch_path(seq, chunk, value_dim):
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    from megatron_hybrid.modules.fast.gdn import scan_chunk_gated_delta_rule

    inputs = make_gdn_inputs(2, seq, 2, 16, value_dim, seed=seq)
    grad_out = torch.randn(2, seq, 2, value_dim, generator=torch.Generator().manual_seed(3))
    _check(scan_chunk_gated_delta_rule, torch_chunk_gated_delta_rule, inputs, grad_out,
           chunk_size=chunk)  # fmt: skip


def test_scan_matches_recurrent_reference_with_states():
    """Independent of megatron's code: the step-by-step recurrence, an initial state carried in
    by running the first half first, and the final state."""
    from megatron_hybrid.modules.fast.gdn import scan_chunk_gated_delta_rule

    inputs = make_gdn_inputs(1, 48, 2, 8, 8, seed=5)
    whole = recurrent_gated_delta_rule(**inputs)
    first = {n: t[:, :20] for n, t in inputs.items()}
    second = {n: t[:, 20:] for n, t in inputs.items()}
    head, state = scan_chunk_gated_delta_rule(**first, chunk_size=8, output_final_state=True)
    tail, _ = scan_chunk_gated_delta_rule(**second, chunk_size=8, initial_state=state)
    bounds = bounds_of(lambda: {"o": recurrent_gated_delta_rule(**inputs)}, measure=rel_error,
                       floor=TOL)  # fmt: skip
    got = {"o": torch.cat([head, tail], dim=1)}
    assert not outside(got, {"o": whole}, bounds, rel_error), (rel_error(got["o"], whole), bounds)


def test_scan_gradients_with_initial_and_final_state():
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    from megatron_hybrid.modules.fast.gdn import scan_chunk_gated_delta_rule

    inputs = make_gdn_inputs(1, 40, 2, 8, 8, seed=6)
    initial = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(1)) * 0.3
    grad_out = torch.randn(1, 40, 2, 8, generator=torch.Generator().manual_seed(2))
    kwargs = dict(chunk_size=8, initial_state=initial, output_final_state=True)
    errors = _check(scan_chunk_gated_delta_rule, torch_chunk_gated_delta_rule, inputs, grad_out,
                    **kwargs)  # fmt: skip
    assert set(errors) >= {"final", "dinitial_state"}


def test_in_kernel_l2norm():
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    from megatron_hybrid.modules.fast.gdn import scan_chunk_gated_delta_rule

    inputs = make_gdn_inputs(1, 30, 2, 8, 8, seed=7)
    inputs["q"], inputs["k"] = inputs["q"] * 3, inputs["k"] * 0.5  # not unit length
    grad_out = torch.randn(1, 30, 2, 8, generator=torch.Generator().manual_seed(2))

    def scan(**tensors):
        return scan_chunk_gated_delta_rule(**tensors, chunk_size=8, use_qk_l2norm_in_kernel=True)

    def normalised_first(q, k, **rest):
        # megatron's path cannot normalise itself (it passes ``dim=`` to fla's l2norm, which has
        # no such argument); normalise as fla does, x / sqrt(sum x^2 + 1e-6), then run it.
        def unit(x):
            return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

        return torch_chunk_gated_delta_rule(unit(q), unit(k), **rest, chunk_size=8)

    _check(scan, normalised_first, inputs, grad_out)


def test_states_one_chunk_late_are_caught(monkeypatch):
    """Negative control: each chunk reading the state after itself instead of before."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    from megatron_hybrid.modules.fast import gdn

    right = gdn._scan_states

    def inclusive(transition, offset, initial):
        states, final = right(transition, offset, initial)
        return torch.cat([states[..., 1:, :, :], final.unsqueeze(-3)], dim=-3), final

    monkeypatch.setattr(gdn, "_scan_states", inclusive)
    inputs = make_gdn_inputs(1, 40, 2, 8, 8, seed=8)
    got, _ = gdn.scan_chunk_gated_delta_rule(**inputs, chunk_size=8)
    expected, _ = torch_chunk_gated_delta_rule(**inputs, chunk_size=8)
    assert rel_error(got, expected) > 100 * TOL


def test_packed_input_is_refused():
    from megatron_hybrid.modules.fast.gdn import scan_chunk_gated_delta_rule

    inputs = make_gdn_inputs(1, 16, 1, 8, 8)
    with pytest.raises(ValueError, match="packed .* needs fla's kernels"):
        scan_chunk_gated_delta_rule(**inputs, cu_seqlens=torch.tensor([0, 8, 16]))


@pytest.mark.parametrize("deterministic, kernel", [(True, "scan"), (False, "fla")],
                         ids=["deterministic", "fla"])  # fmt: skip
def test_fast_gdn_keeps_megatrons_kernel_choice(pg, deterministic, kernel):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_hybrid.modules.fast.gdn import FastGatedDeltaNet, scan_chunk_gated_delta_rule
    from megatron_hybrid.modules.norms import local_norm_impl, plain_gamma_norm
    from megatron_hybrid.testing.models import small_config

    config = small_config("G", deterministic_mode=deterministic)
    spec = ModuleSpec(module=FastGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=plain_gamma_norm(local_norm_impl()),
        out_proj=RowParallelLinear))  # fmt: skip
    layer = build_module(spec, config=config, layer_number=1, pg_collection=pg)
    assert layer.gdn_kernel == kernel
    assert (layer.gated_delta_rule is scan_chunk_gated_delta_rule) == (kernel == "scan")

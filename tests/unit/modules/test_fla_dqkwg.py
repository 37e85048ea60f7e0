"""The package's gated ``chunk_bwd_dqkwg`` (fla's backward on Hopper with Triton 3.4-3.7.0) under
Triton's CPU interpreter: against a float64 oracle to the float32 rounding bound
(``support.dqkwg_reference``), next to fla's own kernel on the same inputs; inside
fla's whole ``chunk_gated_delta_rule`` backward (dispatched through fla's backend registry)
against the float64 step-by-step recurrence. Negative control: the state read transposed. And
the selection: what runs where, and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("fla")
pytest.importorskip("triton")

_SCRIPT = textwrap.dedent("""
    import json, os
    import torch
    from support.triton_interpreter import counting_ranges, one_autotune_config

    one_autotune_config()
    launched = []
    counting_ranges(launched.append)
    from megatron_hybrid.modules.fla_dqkwg import chunk_bwd_dqkwg
    from support.dqkwg_reference import (
        dqkwg_bound, dqkwg_magnitudes, dqkwg_reference)
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg as fla_dqkwg

    BT, K, V = 64, 32, 32

    def inputs(batch, lengths, heads, value_heads, seed):
        gen = torch.Generator().manual_seed(seed)
        tokens = sum(lengths) if batch == 1 and len(lengths) > 1 else lengths[0]
        chunks = sum(-(-n // BT) for n in lengths) if batch == 1 else batch * -(-tokens // BT)
        r = lambda *s: torch.randn(*s, generator=gen)
        t = dict(q=r(batch, tokens, heads, K), k=r(batch, tokens, heads, K) / K ** 0.5,
                 v=r(batch, tokens, value_heads, V), do=r(batch, tokens, value_heads, V),
                 h=r(chunks, value_heads, K, V), dh=r(chunks, value_heads, K, V),
                 w=r(batch, tokens, value_heads, K), dv=r(batch, tokens, value_heads, V))
        # Chunk-local cumulative log2 decays, restarting at every chunk of every sequence.
        steps = -0.5 * torch.rand(batch, tokens, value_heads, generator=gen)
        g = torch.empty_like(steps)
        starts = [0]
        for n in lengths[:-1] if batch == 1 else []:
            starts.append(starts[-1] + n)
        ends = starts[1:] + [tokens]
        for s, e in zip(starts, ends):
            for c in range(s, e, BT):
                g[:, c:min(c + BT, e)] = steps[:, c:min(c + BT, e)].cumsum(1)
        t["g"] = g
        cu = torch.tensor([0, *[sum(lengths[:i + 1]) for i in range(len(lengths))]])
        return t, (cu if batch == 1 and len(lengths) > 1 else None)

    def ratios(out, ref, bound):
        return [None if o is None else float(((o.double() - r).abs() / b).max())
                for o, r, b in zip(out, ref, bound)]

    cases = {
        "dense": (2, [100], 2, 2, False),
        "gva": (2, [128], 1, 2, False),
        "state-v-first": (2, [100], 2, 2, True),
        "varlen": (1, [70, 50, 9], 2, 2, False),
    }
    result = {}
    for name, (batch, lengths, heads, value_heads, v_first) in cases.items():
        t, cu = inputs(batch, lengths, heads, value_heads, seed=len(result))
        h, dh = t["h"], t["dh"]
        if v_first:  # the state stored [V, K]
            h, dh = h.transpose(-1, -2).contiguous(), dh.transpose(-1, -2).contiguous()
        args = dict(q=t["q"], k=t["k"], v=t["v"], do=t["do"], h=h, dh=dh, w=t["w"], g=t["g"],
                    dv=t["dv"], scale=K ** -0.5, state_v_first=v_first, cu_seqlens=cu,
                    chunk_size=BT)
        ref = dqkwg_reference(**args)
        bound = dqkwg_bound(K, V, BT, dqkwg_magnitudes(**args))
        launched.clear()
        ours = chunk_bwd_dqkwg(**args)
        ran = sorted(set(launched))
        theirs = fla_dqkwg(**args)
        flipped = chunk_bwd_dqkwg(**{**args, "h": h.transpose(-1, -2).contiguous(),
                                     "dh": dh.transpose(-1, -2).contiguous()})
        result[name] = dict(ours=ratios(ours, ref, bound), fla=ratios(theirs, ref, bound),
                            control=ratios(flipped, ref, bound), kernels=ran)
    print("RESULT" + json.dumps(result))
""")


def _run(script: str, extra_env: dict | None = None, timeout: int = 900) -> dict:
    tests = str(Path(__file__).resolve().parents[2])  # the support package
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path, **(extra_env or {})}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.fixture(scope="module")
def kernels() -> dict:
    return _run(_SCRIPT)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dense", "gva", "state-v-first", "varlen"])
def test_kernel_within_float32_rounding_of_float64(kernels, case):
    """dq, dk, dw, dg of the package's kernel (and of fla's, on the same inputs) within the
    rounding bound; the state read transposed is not."""
    found = kernels[case]
    assert found["kernels"] == ["dqkwg_kernel"]
    assert max(found["ours"]) <= 1.0, found
    assert max(found["fla"]) <= 1.0, found
    assert max(found["control"]) > 1.0, found


_WHOLE = textwrap.dedent("""
    import json, os
    import torch
    from support.triton_interpreter import counting_ranges, one_autotune_config

    one_autotune_config()
    launched = []
    counting_ranges(launched.append)
    from megatron_hybrid.modules.fla_backend import register_fla_backend
    from support.gdn_reference import make_gdn_inputs, recurrent_gated_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    register_fla_backend()
    inputs = make_gdn_inputs(1, 96, 2, 32, 32, seed=5)
    gen = torch.Generator().manual_seed(6)
    grad = torch.randn(1, 96, 2, 32, generator=gen)

    def run(fn, dtype):
        leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in inputs.items()}
        out = fn(**leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad.to(dtype))
        return {n: leaf.grad.double() for n, leaf in leaves.items()}

    exact = run(recurrent_gated_delta_rule, torch.float64)
    launched.clear()
    ours = run(lambda **t: chunk_gated_delta_rule(**t, use_qk_l2norm_in_kernel=False),
               torch.float32)
    error = {n: float((ours[n] - exact[n]).norm() / exact[n].norm()) for n in exact}
    print("RESULT" + json.dumps(dict(error=error, used="dqkwg_kernel" in launched,
                                     fla_refusal_kernel="chunk_bwd_kernel_dqkwg" in launched)))
""")


@pytest.mark.slow
def test_fla_backward_dispatches_to_it_and_matches_the_recurrence():
    """fla's whole float32 forward and backward, its dq/dk/dw/dg through the package's kernel
    (forced, as on Hopper with Triton 3.6), against the float64 recurrence: every gradient to
    float32 accuracy of the chunked algorithm (1e-4, megatron's torch path's budget in
    tests/functional/test_gdn_kernels_gpu.py); fla's own kernel did not run."""
    found = _run(_WHOLE, {"MEGATRON_HYBRID_FLA_DQKWG": "package"})
    assert found["used"] and not found["fla_refusal_kernel"], found
    assert max(found["error"].values()) < 1e-4, found["error"]


@pytest.mark.parametrize(
    ("capability", "triton", "env", "expected"),
    [
        pytest.param((9, 0), (3, 6, 0), {}, "package", id="hopper-triton-3.6"),
        pytest.param((9, 0), (3, 7, 1), {}, "fla", id="hopper-triton-3.7.1"),
        pytest.param((9, 0), (3, 3, 1), {}, "fla", id="hopper-triton-3.3"),
        pytest.param((10, 0), (3, 6, 0), {}, "fla", id="blackwell"),
        pytest.param((9, 0), (3, 6, 0), {"MEGATRON_HYBRID_FLA_DQKWG": "fla"}, "fla",
                     id="forced-fla"),
        pytest.param((9, 0), (3, 9, 0), {"MEGATRON_HYBRID_FLA_DQKWG": "package"}, "package",
                     id="forced-package"),
        pytest.param((9, 0), (3, 6, 0), {"FLA_DISABLE_BACKEND_DISPATCH": "1"}, "fla",
                     id="dispatch-off"),
    ],
)  # fmt: skip
def test_what_runs_where(monkeypatch, capability, triton, env, expected):
    from megatron_hybrid.modules import fla_backend

    for name in ("MEGATRON_HYBRID_FLA_DQKWG", "FLA_DISABLE_BACKEND_DISPATCH"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(fla_backend, "_triton_version", lambda: triton)
    monkeypatch.setattr(fla_backend, "_tilelang_usable", lambda: False)
    choice, why = fla_backend.dqkwg_choice(capability)
    assert choice == expected and why
    if expected == "package" and not env:
        assert "#640" in why


def test_forced_choice_is_checked(monkeypatch):
    from megatron_hybrid.modules.fla_backend import dqkwg_choice

    monkeypatch.setenv("MEGATRON_HYBRID_FLA_DQKWG", "tilelang")
    with pytest.raises(ValueError, match="expected 'package' or 'fla'"):
        dqkwg_choice((9, 0))

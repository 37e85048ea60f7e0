"""fla's TF32 sites on the chunked GatedDeltaNet path, and the scoped switch to IEEE float32.

Checked without a GPU: in the TTIR that Triton's front end makes for an H100 (sm_90), and, for
the whole forward and backward, under Triton's CPU interpreter with fla's NVIDIA setting of the
merge constant and TF32 operands emulated (truncated to 10 mantissa bits).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support import TESTS_DIR

fla_precision = pytest.importorskip("support.fla_precision")
pytest.importorskip("fla")

HOPPER = ("cuda", 90, 32)


@pytest.fixture
def target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*HOPPER)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_switch_reaches_the_merge_dots(monkeypatch, target, dtype):
    """The 16 merge dots ask for the scope's precision, the 10 k.k dots follow the default."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    kkt = {"ieee": 10} if dtype == torch.float32 else {}  # bf16 k.k dots: precision moot
    for precision, merge in (("tf32", "tf32"), ("tf32x3", "tf32x3"), ("ieee", "ieee")):
        with fla_precision.solve_dot_precision(precision):
            found = fla_precision.solve_kernel_dot_precisions(dtype, target)
        want = {merge: 16}
        for name, count in kkt.items():
            want[name] = want.get(name, 0) + count
        assert dict(found) == want, precision


def test_default_precision_needs_triton_f32_default(monkeypatch, target):
    """Without TRITON_F32_DEFAULT the k.k dots are TF32 even in the IEEE scope."""
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    with fla_precision.solve_dot_precision("ieee"):
        found = fla_precision.solve_kernel_dot_precisions(torch.float32, target)
    assert dict(found) == {"ieee": 16, "tf32": 10}


def test_switch_is_scoped_and_compiles_once():
    module = fla_precision._solve_module()
    shipped = getattr(module, fla_precision.SOLVE_KERNEL)
    with fla_precision.solve_dot_precision("ieee"):
        first = getattr(module, fla_precision.SOLVE_KERNEL)
    with fla_precision.solve_dot_precision("ieee"):
        again = getattr(module, fla_precision.SOLVE_KERNEL)
    assert first is again and first is not shipped
    assert getattr(module, fla_precision.SOLVE_KERNEL) is shipped
    copy, own = fla_precision._innermost(first), fla_precision._innermost(shipped)
    assert copy.fn.__globals__["SOLVE_TRIL_DOT_PRECISION"] == "ieee"
    # The JIT's compile key hashes the constant: copies of another precision compile apart,
    # a copy with fla's own precision has fla's key (same source, same constant).
    with fla_precision.solve_dot_precision("tf32"):
        tf32 = fla_precision._innermost(getattr(module, fla_precision.SOLVE_KERNEL))
    assert tf32.cache_key != copy.cache_key
    same = copy if fla_precision.shipped_solve_precision() == "ieee" else tf32
    assert same.cache_key == own.cache_key


def test_bad_precision_and_unknown_fla_are_named(monkeypatch):
    with pytest.raises(ValueError, match="precision 'fp32'.*expected one of"):
        with fla_precision.solve_dot_precision("fp32"):
            pass
    module = fla_precision._solve_module()
    monkeypatch.delattr(module, fla_precision.SOLVE_CONSTANT)
    with pytest.raises(RuntimeError, match="SOLVE_TRIL_DOT_PRECISION.*redo it"):
        fla_precision.shipped_solve_precision()


_AUDIT = textwrap.dedent("""
    import collections, contextlib, json, sys
    sys.path.insert(0, {root!r})  # tests/, for support
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter
    from triton._C.libtriton import ir
    from support.triton_interpreter import counting_ranges, one_autotune_config

    one_autotune_config()
    running = [None]
    counting_ranges(lambda name: running.__setitem__(0, name))

    # Every float32 dot by kernel and precision; TF32 operands truncated as the GPU reads them.
    dots = collections.Counter()
    create_dot = interpreter.InterpreterBuilder.create_dot
    def truncate(handle):
        bits = np.asarray(handle.data, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
        return interpreter.TensorHandle(bits.view(np.float32), handle.dtype.scalar)
    def recording_dot(self, a, b, d, precision, imprecise):
        if a.data.dtype == np.float32:
            dots[running[0], str(precision).rsplit(".", 1)[-1]] += 1
        if precision == ir.INPUT_PRECISION.TF32:
            a, b = truncate(a), truncate(b)
        return create_dot(self, a, b, d, precision, imprecise)
    interpreter.InterpreterBuilder.create_dot = recording_dot

    import torch
    import fla.ops.gated_delta_rule.chunk_fwd as chunk_fwd
    chunk_fwd.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("tf32")  # fla's value on NVIDIA sm >= 80
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    sys.path.insert(0, {tests!r})
    from test_gdn_gates import _recurrent64
    from test_wy_solve import REGIMES, solve_inputs
    from support.fla_precision import fla_wy_inverse, solve_dot_precision
    from support.gdn_gates import gate_gradients
    from support.wy_solve import check_solve, from_fla_layout, merge_error_bound

    # Weak decays (nearly dependent keys): where TF32 in the merge shows.
    k, _, beta = solve_inputs(*REGIMES[1][1:])
    gen = torch.Generator().manual_seed(1)
    inputs = dict(q=torch.nn.functional.normalize(torch.randn(k.shape, generator=gen), dim=-1),
                  k=k, v=torch.randn(k.shape, generator=gen), beta=beta,
                  alpha=torch.randn(beta.shape, generator=gen),
                  A_log=torch.tensor(REGIMES[1][1]).log(), dt_bias=torch.full((2,), REGIMES[1][2]))
    grad_out = torch.randn(k.shape, generator=gen)
    truth = gate_gradients(_recurrent64, inputs, grad_out, torch.float64)
    result = {{}}
    def fla(*tensors):
        return chunk_gated_delta_rule(*tensors)

    for name, scope in (("shipped", contextlib.nullcontext()),
                        ("ieee", solve_dot_precision("ieee"))):
        dots.clear()
        with scope:
            run = gate_gradients(fla, inputs, grad_out, torch.float32)
            t, g_cum = fla_wy_inverse(k, inputs["v"], run["g"].float(), beta)
        t = from_fla_layout(t)
        result[name] = dict(
            dots=[[kernel, precision, n] for (kernel, precision), n in sorted(dots.items())],
            dg=float((run["dg"] - truth["dg"]).norm() / truth["dg"].norm()),
            **{{"T/" + bound: check_solve(t, k, g_cum, beta, merge_error_bound(
                k, g_cum, beta, operand_roundoff=roundoff)).error_over_bound
               for bound, roundoff in (("ieee", 0.0), ("tf32", 2.0 ** -10))}})
    print("RESULT", json.dumps(result))
    """)


@pytest.mark.slow
def test_tf32_sites_under_triton_interpreter(tmp_path):
    """fla's own kernels on the CPU, forward and backward: where TF32 is, and what it does."""
    pytest.importorskip("triton.runtime.interpreter")
    script = tmp_path / "fla_audit.py"
    script.write_text(_AUDIT.format(tests=os.path.dirname(__file__), root=TESTS_DIR))
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "TRITON_F32_DEFAULT": "ieee"}  # fmt: skip
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    shipped, ieee = result["shipped"], result["ieee"]
    # Only the fused solve kernel asks for TF32, and only while fla's constant says so;
    # solve_tril (FLA_TRIL_PRECISION's kernels) never runs on this path.
    assert {k for k, p, _ in shipped["dots"] if p != "IEEE"} == {fla_precision.SOLVE_KERNEL}
    assert {p for _, p, _ in ieee["dots"]} == {"IEEE"}
    assert not any("solve_tril" in k for k, _, _ in shipped["dots"] + ieee["dots"])
    # fla's own T: within the TF32 bound and beyond the IEEE one as shipped, IEEE in the scope.
    assert shipped["T/tf32"] <= 1 < shipped["T/ieee"]
    assert ieee["T/ieee"] <= 1
    # At these weak decays the TF32 merge moves dg well beyond IEEE float32's own error.
    assert ieee["dg"] < 1e-4
    assert shipped["dg"] > 10 * ieee["dg"]

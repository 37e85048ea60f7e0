"""Where fla's chunked GatedDeltaNet runs float32 dots in TF32, and a scoped switch to IEEE.

Audit of fla 0.6.0's ``chunk_gated_delta_rule`` forward and backward as megatron-core's
``GatedDeltaNet`` calls it (``g`` given, chunk size 64, no in-kernel gate, l2norm or beta
sigmoid), on Triton 3.9:

* ``tl.dot`` on float32 operands takes its precision from ``input_precision``; when that is
  ``None`` (also with ``allow_tf32=False``) from ``TRITON_F32_DEFAULT``, and otherwise TF32 on
  NVIDIA GPUs (``triton/language/core.py``, ``dot``). The variable is read when a kernel
  compiles, and Triton keys its on-disk cache by it but not its in-process one: it must be set
  before the first compile.
* One explicit precision on the path: the 16 block-merge dots of the WY inverse in
  ``fla/ops/gated_delta_rule/chunk_fwd.py``, ``chunk_gated_delta_rule_fwd_kkt_solve_kernel``,
  pass ``input_precision=SOLVE_TRIL_DOT_PRECISION``, a module constant that fla sets to
  ``'tf32'`` when ``fla.utils.IS_TF32_SUPPORTED`` (NVIDIA, compute capability >= 8) and to
  ``'ieee'`` otherwise. ``TRITON_F32_DEFAULT`` does not reach them. Their operands are float32
  in bf16 runs too (the merged blocks are float32).
* Every other dot on the path (the fused kernel's ``k . k``, ``recompute_w_u_fwd`` (one with
  ``allow_tf32=False``), ``chunk_gated_delta_rule_fwd_h`` / ``bwd_dhu``, ``chunk_fwd_o``,
  ``chunk_bwd_dv_local``, ``chunk_bwd_dqkwg``, ``prepare_wy_repr_bwd``) follows
  ``TRITON_F32_DEFAULT``; in bf16 runs most of them take bf16 operands, where it is moot.
* ``fla/ops/utils/solve_tril.py`` (its precision from ``FLA_TRIL_PRECISION``) runs only for
  chunk sizes 16 and 32: ``FLA_TRIL_PRECISION`` changes nothing on this path.
* The backward does not invert again: it reuses the ``T`` the forward saved.

So float32 GatedDeltaNet on an Ampere or Hopper GPU is IEEE float32 only with
``TRITON_F32_DEFAULT=ieee`` set before the first compile *and* the merge's constant set to
``'ieee'`` before the solve kernel first compiles. :func:`solve_dot_precision` does the latter
for a scope, without touching fla's own kernel: it swaps in a copy of the kernel that sees the
requested constant, so fla's shipped kernel and the copy compile and run side by side in one
process (changing the module constant after a compile would make Triton 3.9's
``JITFunction.run`` raise "Global variable SOLVE_TRIL_DOT_PRECISION has changed since we compiled
this kernel" at the next launch). :func:`dot_precisions` reads the precisions a
kernel's TTIR asks for (also on a machine without a GPU), which shows the switch reaching the
compiled code.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib
import re
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "OPERAND_ROUNDOFF",
    "SOLVE_KERNEL",
    "dot_precisions",
    "fla_wy_inverse",
    "shipped_solve_precision",
    "solve_dot_precision",
]

#: fla 0.6.0's fused kkt + WY-inverse kernel and the constant its block merge reads.
SOLVE_MODULE = "fla.ops.gated_delta_rule.chunk_fwd"
SOLVE_KERNEL = "chunk_gated_delta_rule_fwd_kkt_solve_kernel"
SOLVE_CONSTANT = "SOLVE_TRIL_DOT_PRECISION"

#: Unit roundoff of a float32 dot operand at each Triton input precision on NVIDIA GPUs: TF32
#: operands are truncated (10 stored mantissa bits), 3xTF32 splits each operand into two TF32
#: parts (about ``u^2`` left, doubled for the split's own truncation).
OPERAND_ROUNDOFF = {"ieee": 0.0, "tf32x3": 2.0**-18, "tf32": 2.0**-10}

_CLONES: dict[tuple[int, str], Any] = {}


def _solve_module() -> types.ModuleType:
    module = importlib.import_module(SOLVE_MODULE)
    missing = [name for name in (SOLVE_KERNEL, SOLVE_CONSTANT) if not hasattr(module, name)]
    if missing:
        import fla

        raise RuntimeError(
            f"fla {fla.__version__}: {SOLVE_MODULE} has no {', '.join(missing)}; the precision "
            "audit in tests/support/fla_precision.py is for fla 0.6.0: redo it for "
            "this version"
        )
    return module


def shipped_solve_precision() -> str:
    """The precision fla chose for its block merge on this machine (``'tf32'`` or ``'ieee'``)."""
    constant = getattr(_solve_module(), SOLVE_CONSTANT)
    return str(getattr(constant, "value", constant))


def _innermost(kernel: Any) -> Any:
    """The ``@triton.jit`` function under fla's heuristics / autotune wrappers."""
    while hasattr(kernel, "fn") and not isinstance(kernel.fn, types.FunctionType):
        kernel = kernel.fn
    return kernel


def _clone(kernel: Any, **constants: Any) -> Any:
    """``kernel`` (wrappers included) whose Python function sees ``constants`` as globals."""
    import triton

    jit = _innermost(kernel)
    fn = jit.fn
    twin = types.FunctionType(
        fn.__code__, {**fn.__globals__, **constants}, fn.__name__, fn.__defaults__,
        fn.__closure__,
    )  # fmt: skip
    for attribute in ("__qualname__", "__module__", "__doc__", "__annotations__", "__kwdefaults__"):
        setattr(twin, attribute, copy.copy(getattr(fn, attribute)))
    registry = getattr(triton.runtime.jit, "_triton_jit_function_registry", {})
    key = f"{fn.__module__}:{fn.__qualname__}"
    registered = registry.get(key)
    options = getattr(jit, "kwargs", None)  # the interpreter's InterpretedFunction
    if options is None:
        options = dict(
            version=jit.version, do_not_specialize=jit.do_not_specialize,
            do_not_specialize_on_alignment=jit.do_not_specialize_on_alignment,
            debug=jit.debug, noinline=jit.noinline, repr=jit._repr,
            launch_metadata=jit.launch_metadata,
        )  # fmt: skip
    jitted = triton.jit(twin, **options)
    if registered is not None:  # the new JITFunction registered itself under fla's name
        registry[key] = registered

    def rewrap(wrapper):
        if wrapper is jit:
            return jitted
        outer = copy.copy(wrapper)
        outer.fn = rewrap(wrapper.fn)
        if isinstance(getattr(wrapper, "cache", None), dict):  # autotuner: the configs it chose
            outer.cache = dict(wrapper.cache)
        return outer

    return rewrap(kernel)


@contextlib.contextmanager
def solve_dot_precision(precision: str) -> Iterator[None]:
    """Within the scope, fla's WY-inverse block merge uses ``precision`` (``'ieee'``, ``'tf32'``,
    ``'tf32x3'``) for its float32 dots, in forward and (through the saved inverse) backward.

    fla's kernel is left as it is and used again after the scope; the copy for each precision
    compiles once per process. For IEEE float32 throughout, ``TRITON_F32_DEFAULT=ieee`` must also
    be set before the first compile (see the module doc).
    """
    import triton.language as tl

    if precision not in OPERAND_ROUNDOFF:
        raise ValueError(f"precision {precision!r}: expected one of {sorted(OPERAND_ROUNDOFF)}")
    module = _solve_module()
    shipped = getattr(module, SOLVE_KERNEL)
    key = (id(shipped), precision)
    if key not in _CLONES:
        _CLONES[key] = _clone(shipped, **{SOLVE_CONSTANT: tl.constexpr(precision)})
    setattr(module, SOLVE_KERNEL, _CLONES[key])
    try:
        yield
    finally:
        setattr(module, SOLVE_KERNEL, shipped)


def dot_precisions(
    kernel: Any, signature: dict, constants: dict, target: Any
) -> collections.Counter:
    """How many float32 ``tt.dot`` of ``kernel``'s TTIR ask for each input precision.

    Only dots with float32 operands count (on bf16 operands the precision is moot); a dot without
    an ``inputPrecision`` attribute is ``'ieee'``. Runs Triton's front end only (no GPU needed).
    ``signature`` maps every non-constant argument to its Triton type (``'*fp32'``, ``'i32'``),
    ``constants`` the constexpr ones to values; ``target`` is a
    ``triton.backends.compiler.GPUTarget``. The default precision comes from
    ``TRITON_F32_DEFAULT`` as it is now.
    """
    from triton._C.libtriton import ir
    from triton.compiler.compiler import ASTSource, make_backend

    jit = _innermost(kernel)
    backend = make_backend(target)
    options = backend.parse_options({})
    source = ASTSource(jit, {**signature, **{name: "constexpr" for name in constants}}, constants)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options),
                            backend.get_module_map(), context)  # fmt: skip
    found = collections.Counter()
    for dot in re.findall(r"tt\.dot [^\n]*", str(module)):
        operands = dot.rsplit(" : ", 1)[-1].split("->")[0]
        if "xf32>" not in operands:
            continue
        match = re.search(r"inputPrecision = (\w+)", dot)
        found[match.group(1) if match else "ieee"] += 1
    return found


def solve_kernel_dot_precisions(dtype: torch.dtype, target: Any) -> collections.Counter:
    """:func:`dot_precisions` of the solve kernel now in fla's module, for ``dtype`` keys."""
    ptr = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}[dtype]
    signature = dict(k=ptr, g="*fp32", beta=ptr, A=ptr, T="i32")
    constants = dict(cu_seqlens=None, chunk_indices=None, H=2, HV=2, K=16, BT=64, BC=16, BK=32,
                     USE_G=True, IS_VARLEN=False)  # fmt: skip
    return dot_precisions(getattr(_solve_module(), SOLVE_KERNEL), signature, constants, target)


def fla_wy_inverse(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's ``T`` for these rule inputs, as its forward computes it: ``(T, g_cum)``.

    ``T`` in fla's layout ``[B, T, H, 64]`` (see ``wy_solve.from_fla_layout``) and the
    chunk-local log2 cumsum of ``g`` that the kernel saw (fla 0.6.0's ``chunk_local_cumsum``
    with ``RCP_LN2``, then ``chunk_gated_delta_rule_fwd_intra``, as ``chunk_gated_delta_rule_fwd``
    calls them). Uses the solve kernel in fla's module now (see :func:`solve_dot_precision`).
    """
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    intra = _solve_module().chunk_gated_delta_rule_fwd_intra
    g_cum = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
    _, _, t = intra(k=k, v=v, g=g_cum, beta=beta, chunk_size=64)
    return t, g_cum

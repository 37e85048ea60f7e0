"""Which kernel computes GatedDeltaNet's ``dq, dk, dw, dg`` inside fla's backward, and why.

fla 0.6.0 picks implementations through its backend registry (``fla/backends.py``): an operation
such as ``chunk_bwd_dqkwg`` (``ops/common/chunk_o.py``, dispatched as part of the ``common``
operations) runs the first registered backend that is available, enabled and accepts the call
(its verifier), else fla's own Triton kernel. fla's own kernel refuses the gated case on Hopper
with Triton >= 3.4.0, < 3.7.1 (issue #640: those Triton versions miscompile it), and fla's only
alternative there is TileLang, which the stock GPU image does not have. So GatedDeltaNet could
not train there.

:func:`dqkwg_choice` decides, in one place, and :func:`register_fla_backend` registers the
package's kernel (:mod:`~megatron_hybrid.modules.fla_dqkwg`: the same computation without the
miscompiled pattern) as a backend of fla's registry whose verifier follows that choice:

* ``"package"`` where fla's Triton kernel is refused: Hopper (compute capability 9.x), Triton
  3.4.0 up to 3.7.0, and no usable TileLang;
* ``"fla"`` everywhere else: fla's own kernel (or its TileLang one) is correct there;
* ``MEGATRON_HYBRID_FLA_DQKWG=package`` or ``=fla`` forces either (to time one against the other
  on a newer Triton, or to test the package's kernel on any GPU).

Registering changes nothing else in fla; with ``FLA_DISABLE_BACKEND_DISPATCH=1`` fla ignores
every backend, and the choice says so.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from megatron_hybrid.modules.fla_dqkwg import chunk_bwd_dqkwg

__all__ = ["DQKWG_ENV", "dqkwg_choice", "register_fla_backend"]

#: Forces the choice: ``package`` or ``fla``.
DQKWG_ENV = "MEGATRON_HYBRID_FLA_DQKWG"
#: Triton versions whose code for fla's ``chunk_bwd_kernel_dqkwg`` is wrong on Hopper (#640).
BAD_TRITON = ((3, 4, 0), (3, 7, 1))


@functools.cache
def _triton_version() -> tuple[int, ...] | None:
    try:
        import triton
    except ImportError:
        return None
    return tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:3])


@functools.cache
def _tilelang_usable() -> bool:
    if importlib.util.find_spec("tilelang") is None:
        return False
    from fla.utils import has_usable_nvcc  # lazy: fla

    return bool(has_usable_nvcc())


def dqkwg_choice(capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """``("package" | "fla", why)`` for the gated ``chunk_bwd_dqkwg`` on this machine.

    Args:
        capability: the GPU's compute capability (default: the current CUDA device's; None
            without CUDA).
    """
    forced = os.environ.get(DQKWG_ENV)
    if forced:
        if forced not in ("package", "fla"):
            raise ValueError(f"{DQKWG_ENV}={forced!r}: expected 'package' or 'fla'")
        return forced, f"{DQKWG_ENV}={forced}"
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return "fla", "FLA_DISABLE_BACKEND_DISPATCH=1: fla dispatches to no backend"
    if capability is None:
        import torch

        if not torch.cuda.is_available():
            return "fla", "no CUDA device (fla's kernels need one)"
        capability = torch.cuda.get_device_capability()
    version = _triton_version()
    if version is None:
        return "fla", "Triton is not installed"
    shown = ".".join(map(str, version))
    if capability[0] != 9 or not BAD_TRITON[0] <= version < BAD_TRITON[1]:
        return "fla", f"fla's Triton kernel is correct with Triton {shown} on sm_{capability[0]}x"
    if _tilelang_usable():
        return "fla", "fla's TileLang kernel replaces its Triton one here"
    return (
        "package",
        f"Triton {shown} on Hopper miscompiles fla's kernel (fla #640), which fla then refuses; "
        "the package's kernel computes the same without the transposed accumulator",
    )


def _verifier(self, q, k, v, do, h, dh, w=None, g=None, g_gamma=None, *args, **kwargs):
    if g is None or g_gamma is not None:
        return False, "the package's kernel computes the gated rule only"
    choice, why = dqkwg_choice()
    return choice == "package", why


def _implementation(self, *args, **kwargs):
    return chunk_bwd_dqkwg(*args, **kwargs)


@functools.cache
def register_fla_backend() -> bool:
    """Register the package's ``chunk_bwd_dqkwg`` with fla's ``common`` operations (once per
    process); False where fla is not installed."""
    if importlib.util.find_spec("fla") is None:
        return False
    from fla.backends import BaseBackend, register  # lazy: fla

    backend = type(
        "MegatronHybridDqkwgBackend",
        (BaseBackend,),
        {
            "__doc__": "megatron_hybrid's gated chunk_bwd_dqkwg (see dqkwg_choice).",
            "backend_type": "megatron_hybrid",
            "priority": 4,  # before TileLang (5) where the choice is the package's
            "chunk_bwd_dqkwg_verifier": _verifier,
            "chunk_bwd_dqkwg": _implementation,
        },
    )
    register("common")(backend)
    return True

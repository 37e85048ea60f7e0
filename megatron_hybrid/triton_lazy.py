"""Triton kernels built on first use, and None where Triton cannot be imported.

The package's Triton kernels (the fast path's gathers, RoPE, grouped adds and weight gradients; the
row statistics of vocabulary logits and the cross entropy's backward) are optional: Triton is not a
dependency of the CPU install, and each kernel's caller falls back to torch operators where it is
missing. Importing Triton and compiling a ``triton.jit`` function on module import would make every
import of the package pay for it, and fail without Triton; :func:`lazy_triton` defers both to the
first call, once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_triton"]


def lazy_triton(build: Callable[[Any, Any], Any]) -> Callable[[], Any]:
    """``build(triton, triton.language)`` on the first call, its result kept; None (every call)
    where Triton cannot be imported.

    Use as a decorator on a function that defines its ``@triton.jit`` kernel and returns it
    (with whatever helpers its caller needs, e.g. ``triton.cdiv``)."""

    @functools.cache
    def kernel():
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return build(triton, tl)

    functools.update_wrapper(kernel, build)
    return kernel

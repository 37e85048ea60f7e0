"""``torch.compile`` for small pure pieces, with an eager fallback and a record of its cost.

A piece of torch arithmetic full of elementwise steps (Mamba2's chunked scan, its gated norm)
launches one kernel per step in eager mode; inductor fuses the steps between the matmuls into a
few generated kernels. Compilation costs seconds per piece and input shape, and can fail (an
unsupported operation, a Triton that inductor does not know), so :class:`CompiledPiece`:

* compiles lazily on the first call, ``dynamic=False`` (one graph per input shape);
* runs the eager function instead where TorchDynamo is disabled (the CPU runtime back-end
  disables it), where ``MEGATRON_HYBRID_COMPILE=0`` is set in the environment, or where a
  compilation failed, with the failure kept in ``failure`` and warned once;
* times each call that compiled (the first call per input signature) into
  :data:`COMPILE_SECONDS`, which benchmarks report. The backward graph is compiled during the
  first backward and is not in these times; it shows in the first step's time.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable

import torch

__all__ = ["COMPILE_SECONDS", "CompiledPiece"]

#: piece name -> seconds spent in calls that compiled (first call per input signature).
COMPILE_SECONDS: dict[str, float] = {}


def _dynamo_disabled() -> bool:
    import torch._dynamo

    return bool(torch._dynamo.config.disable) or os.environ.get("MEGATRON_HYBRID_COMPILE") == "0"


def _signature(args, kwargs) -> tuple:
    def describe(a):
        if isinstance(a, torch.Tensor):
            return (tuple(a.shape), a.dtype, a.device.type, a.requires_grad)
        return a

    return tuple(map(describe, args)) + tuple((k, describe(v)) for k, v in sorted(kwargs.items()))


class CompiledPiece:
    """``fn`` through ``torch.compile`` where that works, else ``fn`` itself.

    Args:
        fn: a pure function of tensors and Python constants.
        name: the name its compile time is recorded under.
        backend: ``torch.compile``'s backend (``"inductor"``: generated fused kernels).
    """

    def __init__(self, fn: Callable, name: str, backend: str = "inductor"):
        self.fn, self.name, self.backend = fn, name, backend
        self.failure: str | None = None
        self._compiled: Callable | None = None
        self._seen: set[tuple] = set()

    def __call__(self, *args, **kwargs):
        if self.failure is not None or _dynamo_disabled():
            return self.fn(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=False, backend=self.backend)
        signature = _signature(args, kwargs)
        new = signature not in self._seen
        began = time.perf_counter()
        try:
            out = self._compiled(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any compiler failure falls back to eager
            self.failure = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
            warnings.warn(
                f"torch.compile of {self.name} failed; running it eagerly ({self.failure})",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.fn(*args, **kwargs)
        if new:
            self._seen.add(signature)
            COMPILE_SECONDS[self.name] = (
                COMPILE_SECONDS.get(self.name, 0.0) + time.perf_counter() - began
            )
        return out

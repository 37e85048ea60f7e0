"""``torch.compile`` for small pure pieces, with an eager fallback and a record of its cost.

A piece of torch arithmetic full of elementwise steps (Mamba2's chunked scan, its gated norm)
launches one kernel per step in eager mode; inductor fuses the steps between the matmuls into a
few generated kernels. Compilation costs seconds per piece and graph, and can fail (an
unsupported operation, a Triton that inductor does not know), so :class:`CompiledPiece`:

* compiles lazily on the first call, with TorchDynamo's automatic dynamic shapes
  (``dynamic=None``): the first input shape gets a graph specialised to it, and the first call
  with another shape recompiles once with the changed sizes symbolic, which then serves every
  later length. Training on variable-length micro-batches therefore compiles twice, not once per
  length (with ``dynamic=False`` each new length recompiled until TorchDynamo's recompile limit,
  8, and then ran eagerly);
* runs the eager function instead where TorchDynamo is disabled (``TORCHDYNAMO_DISABLE=1``; the
  CPU runtime back-end disables it), where ``MEGATRON_HYBRID_COMPILE=0`` is set in the
  environment, or where a compilation failed, with the failure kept in ``failure`` and warned
  once;
* counts the graphs it compiles (``compiles``: the backend is called once per graph) and times
  the calls that compiled into :data:`COMPILE_SECONDS`, which benchmarks report. The backward
  graph is compiled during the first backward and is not in these times; it shows in the first
  step's time.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable

import torch

__all__ = ["COMPILE_SECONDS", "CompiledPiece"]

#: piece name -> seconds spent in calls that compiled a graph.
COMPILE_SECONDS: dict[str, float] = {}


def _dynamo_disabled() -> bool:
    import torch._dynamo

    return (
        bool(torch._dynamo.config.disable)
        or os.environ.get("TORCHDYNAMO_DISABLE") == "1"  # torch.compile would run eagerly
        or os.environ.get("MEGATRON_HYBRID_COMPILE") == "0"
    )


class CompiledPiece:
    """``fn`` through ``torch.compile`` where that works, else ``fn`` itself.

    Args:
        fn: a pure function of tensors and Python constants.
        name: the name its compile time is recorded under.
        backend: ``torch.compile``'s backend (``"inductor"``: generated fused kernels).
        dynamic: ``torch.compile``'s ``dynamic`` (None: automatic dynamic shapes, see the
            module doc; False specialises every graph to one shape).
    """

    def __init__(
        self, fn: Callable, name: str, backend: str = "inductor", dynamic: bool | None = None
    ):
        self.fn, self.name, self.backend, self.dynamic = fn, name, backend, dynamic
        self.failure: str | None = None
        self.compiles = 0
        self._compiled: Callable | None = None

    def _counting_backend(self) -> Callable:
        """The backend, counting the graphs it is given."""
        import torch._dynamo

        real = torch._dynamo.lookup_backend(self.backend)

        def backend(graph, example_inputs):
            self.compiles += 1
            return real(graph, example_inputs)

        return backend

    def __call__(self, *args, **kwargs):
        if self.failure is not None or _dynamo_disabled():
            return self.fn(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(
                self.fn, dynamic=self.dynamic, backend=self._counting_backend()
            )
        before = self.compiles
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
        if self.compiles != before:
            COMPILE_SECONDS[self.name] = (
                COMPILE_SECONDS.get(self.name, 0.0) + time.perf_counter() - began
            )
        return out

"""fla's Triton kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``), for tests.

Two things differ from compiled Triton that fla's GatedDeltaNet kernels notice: the interpreter
cannot time an autotuner's configs, and its ``range`` yields Python ints where compiled loop
counters are tensors with ``.to()``. Call both patches before fla imports its kernels, in a
process started with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable

__all__ = ["counting_ranges", "one_autotune_config"]


def one_autotune_config() -> None:
    """Every autotuned kernel keeps only its first config."""
    import triton.runtime.autotuner as autotuner  # lazy: Triton, in interpreter processes only

    init = autotuner.Autotuner.__init__

    def first_config(self, fn, names, configs, *args, **kwargs):
        init(self, fn, names, configs[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = first_config


def counting_ranges(on_launch: Callable[[str], None] | None = None) -> None:
    """Kernels launched from now on see a ``range`` of ints with ``.to()``; ``on_launch`` is
    told each launched kernel's name first."""
    import triton.language as tl  # lazy: Triton, in interpreter processes only
    import triton.runtime.interpreter as interpreter

    class Counter(int):
        def to(self, dtype, *args, **kwargs):
            return tl.full((), int(self), dtype)

    def counting_range(*args):
        return (Counter(i) for i in builtins.range(*(int(a) for a in args)))

    call = interpreter.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        self.fn.__globals__["range"] = counting_range
        if on_launch is not None:
            on_launch(self.fn.__name__)
        return call(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = launch

"""Triton kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``), for tests.

:func:`run_under_interpreter` runs a test script in a process of its own with the interpreter
on (it must be set before Triton is imported), as the package's own kernels' tests do.

Two things differ from compiled Triton that fla's GatedDeltaNet kernels notice: the interpreter
cannot time an autotuner's configs, and its ``range`` yields Python ints where compiled loop
counters are tensors with ``.to()``. Call both patches before fla imports its kernels, in a
process started with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["counting_ranges", "one_autotune_config", "run_under_interpreter"]


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


def run_under_interpreter(script: str, folder: Path, marker: str) -> str:
    """Run ``script`` (Python source) in a new process under Triton's CPU interpreter, no GPU
    visible; assert it ended well and printed ``marker``. Returns its standard output."""
    path = Path(folder) / "under_interpreter.py"
    path.write_text(script)
    tests = str(Path(__file__).resolve().parents[1])  # scripts may import test modules' support
    path_entries = [tests, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(path_entries)}  # fmt: skip
    done = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert marker in done.stdout, done.stdout[-3000:]
    return done.stdout

"""Runtime back-ends: where a process runs megatron-core (CUDA GPUs, or the CPU emulation).

An entry point (the CLI, a test fixture, a benchmark) chooses the back-end once, before it
builds a model: ``backend = select_backend(); backend.activate()``. Library code below this
layer never patches the process; it asks the chosen back-end for its config overrides and
device instead.
"""

from megatron_hybrid.runtime.backend import (
    BACKEND_NAMES,
    RuntimeBackend,
    prefer_expandable_segments,
    select_backend,
)

__all__ = ["BACKEND_NAMES", "RuntimeBackend", "prefer_expandable_segments", "select_backend"]

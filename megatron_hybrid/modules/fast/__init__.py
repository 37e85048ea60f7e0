"""The fast TE-free GPU path of the ``local`` spec backend.

``hybrid_stack_spec("local")`` builds these subclasses of the reference modules where CUDA is
available (``local_impl="auto"``; ``"fast"`` / ``"reference"`` force either): SDPA core
attention (``*``, ``+``), grouped-GEMM routed experts with a dispatcher that does not wait for
the host at EP = 1 (``E``), a parallel-scan torch path for GatedDeltaNet (``G``) and a compiled
torch Mamba2 path (``M``). Parameters and checkpoints are the reference modules'. Where a fast
module cannot compute a call (see :mod:`~megatron_hybrid.modules.fast.selection`), it runs the
reference forward and says why in ``fast_path_reason``; :func:`fast_path_report` collects
those. ``docs/performance.md`` has the numbers.
"""

from megatron_hybrid.modules.fast.grouped_linear import mark_idle_grad_hooks
from megatron_hybrid.modules.fast.selection import (
    LOCAL_IMPLS,
    fast_path_report,
    resolve_local_impl,
)

__all__ = ["LOCAL_IMPLS", "fast_path_report", "mark_idle_grad_hooks", "resolve_local_impl"]

"""Hybrid layer stacks (``HybridStack``, specs, layer registry, norms).

``HybridModel`` lives one layer up, in :mod:`megatron_hybrid.model` (it needs the EP-overlap
schedule plan, which is built on this package); import it as ``from megatron_hybrid import
HybridModel``.
"""

from typing import Any

from megatron_hybrid.modules import (
    layer_types,  # noqa: F401 - registers the built-in types
    registry,
)
from megatron_hybrid.modules.hybrid_stack import HybridStack
from megatron_hybrid.modules.norms import TorchNorm
from megatron_hybrid.modules.registry import (
    LAYER_RUNTIMES,
    LayerRuntime,
    ScheduleRole,
    TerminalSlots,
    layer_runtime,
    register_layer_type,
    unregister_layer_type,
)
from megatron_hybrid.modules.specs import HybridStackSubmodules, hybrid_stack_spec

__all__ = [
    "LAYER_RUNTIMES",
    "HybridStack",
    "HybridStackSubmodules",
    "LayerRuntime",
    "ScheduleRole",
    "TerminalSlots",
    "TorchNorm",
    "hybrid_stack_spec",
    "layer_runtime",
    "register_layer_type",
    "unregister_layer_type",
]


def __getattr__(name: str) -> Any:
    if name in ("LayerKind", "LAYER_KINDS"):
        # The registry's pre-table names: deprecated, resolved (with a warning) there.
        return getattr(registry, name)
    raise AttributeError(f"module 'megatron_hybrid.modules' has no attribute {name!r}")

"""Hybrid layer stacks and models (``HybridStack``, ``HybridModel``, specs, layer-type registry)."""

from typing import Any

from megatron_hybrid.modules.hybrid_model import HybridModel
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
    "HybridModel",
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
    # The registry's pre-table names (LayerKind, LAYER_KINDS): deprecated, resolved there.
    if name in ("LayerKind", "LAYER_KINDS"):
        from megatron_hybrid.modules import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

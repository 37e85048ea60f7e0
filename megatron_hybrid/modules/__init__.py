"""Hybrid layer stacks (``HybridStack``, specs, layer registry, norms).

``HybridModel`` lives one layer up, in :mod:`megatron_hybrid.model` (it needs the EP-overlap
schedule plan, which is built on this package); import it as ``from megatron_hybrid import
HybridModel``. ``megatron_hybrid.modules.HybridModel`` still resolves, with a
``DeprecationWarning``, until 0.2.
"""

import warnings
from typing import Any

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
        from megatron_hybrid.modules import registry

        return getattr(registry, name)
    if name == "HybridModel":
        # Deprecated alias (since 0.1.x): the one upward import in the package, listed in
        # docs/architecture.md and allowed by name in tests/unit/test_layering.py.
        warnings.warn(
            "megatron_hybrid.modules.HybridModel is deprecated; use "
            "`from megatron_hybrid import HybridModel` (removed in 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        from megatron_hybrid.model import HybridModel

        return HybridModel
    raise AttributeError(f"module 'megatron_hybrid.modules' has no attribute {name!r}")

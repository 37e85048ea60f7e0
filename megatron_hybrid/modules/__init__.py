"""Hybrid layer stacks (``HybridStack``, specs, layer registry, norms).

``HybridModel`` lives one layer up, in :mod:`megatron_hybrid.model` (it needs the EP-overlap
schedule plan, which is built on this package); import it as ``from megatron_hybrid import
HybridModel``. ``megatron_hybrid.modules.HybridModel`` still resolves, with a
``DeprecationWarning``, until 0.2.
"""

import warnings

from megatron_hybrid.modules.hybrid_stack import HybridStack
from megatron_hybrid.modules.norms import TorchNorm
from megatron_hybrid.modules.registry import LAYER_KINDS, LayerKind, register_layer_kind
from megatron_hybrid.modules.specs import HybridStackSubmodules, hybrid_stack_spec

__all__ = [
    "LAYER_KINDS",
    "HybridStack",
    "HybridStackSubmodules",
    "LayerKind",
    "TorchNorm",
    "hybrid_stack_spec",
    "register_layer_kind",
]


def __getattr__(name: str):
    # Deprecated alias (since 0.1.x): the one upward import in the package, listed in
    # docs/architecture.md and allowed by name in tests/unit/test_layering.py.
    if name == "HybridModel":
        warnings.warn(
            "megatron_hybrid.modules.HybridModel is deprecated; use "
            "`from megatron_hybrid import HybridModel` (removed in 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        from megatron_hybrid.model import HybridModel

        return HybridModel
    raise AttributeError(f"module 'megatron_hybrid.modules' has no attribute {name!r}")

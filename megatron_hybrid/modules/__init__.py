"""Hybrid layer stacks and models (``HybridStack``, ``HybridModel``, specs, layer registry)."""

from megatron_hybrid.modules.hybrid_model import HybridModel
from megatron_hybrid.modules.hybrid_stack import HybridStack
from megatron_hybrid.modules.norms import TorchNorm
from megatron_hybrid.modules.registry import LAYER_KINDS, LayerKind, register_layer_kind
from megatron_hybrid.modules.specs import HybridStackSubmodules, hybrid_stack_spec

__all__ = [
    "LAYER_KINDS",
    "HybridModel",
    "HybridStack",
    "HybridStackSubmodules",
    "LayerKind",
    "TorchNorm",
    "hybrid_stack_spec",
    "register_layer_kind",
]

"""megatron_hybrid: hybrid layer stacks for Megatron-Core.

Grouped layer patterns (``[*E]{24}``, ``[GE]{3}[*E]``), GPTModel-compatible checkpoints,
combined-1F1B expert-parallel overlap and HybridEP-aligned padding. Importing the package has no
side effects and does not import torch; the model classes load on first access.
"""

from __future__ import annotations

import importlib

from megatron_hybrid.package_info import __version__

# Public name -> package that exports it.
_LAZY = {
    "HybridModel": "megatron_hybrid.model",
    "HybridStack": "megatron_hybrid.modules",
    "HybridStackSubmodules": "megatron_hybrid.modules",
    "hybrid_stack_spec": "megatron_hybrid.modules",
}

__all__ = [
    "HybridModel",
    "HybridStack",
    "HybridStackSubmodules",
    "__version__",
    "hybrid_stack_spec",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'megatron_hybrid' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))

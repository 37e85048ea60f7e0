"""The runtime part of each built-in layer type, one module per type.

Each module defines ``RUNTIME``, a :class:`~megatron_hybrid.modules.registry.LayerRuntime`; the
facts of the same types are in :mod:`megatron_hybrid.pattern.layer_types`. This package is the
one place the built-ins are registered, in table order; :mod:`megatron_hybrid.modules` imports
it, so every import of the modules package has them (the registry never imports its entries). A
new layer type does not go here: it calls
:func:`~megatron_hybrid.modules.registry.register_layer_type` with its own facts and runtime.
"""

from megatron_hybrid.modules.layer_types import attention, dsa, gdn, mamba, mla, mlp, moe
from megatron_hybrid.modules.registry import register_builtin_runtime

__all__ = ["attention", "dsa", "gdn", "mamba", "mla", "mlp", "moe"]

for _module in (mamba, gdn, attention, dsa, mla, mlp, moe):
    register_builtin_runtime(_module.RUNTIME)

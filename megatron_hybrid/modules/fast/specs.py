"""The fast path as a substitution on the ``local`` backend's layer specs.

:data:`FAST_CLASSES` maps each reference class of the ``local`` backend to its fast subclass;
:func:`fast_layer_specs` rebuilds a backend's layer specs with every occurrence replaced,
wherever it sits (``ModuleSpec.module``, a ``functools.partial`` such as megatron's MoE layer
builder, a submodules dataclass, the MTP block's layer specs). The fast classes subclass the
reference classes, so parameters, checkpoint keys and constructor arguments stay those of the
reference path; a new fast module is one entry here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_hybrid.modules.attention import LocalCoreAttention, MLACoreAttention
from megatron_hybrid.modules.fast.attention import (
    FastSelfAttention,
    SDPACoreAttention,
    SDPAMLACoreAttention,
)
from megatron_hybrid.modules.fast.dispatch import FastMoELayer
from megatron_hybrid.modules.fast.experts import GroupedGemmExperts
from megatron_hybrid.modules.fast.gdn import FastGatedDeltaNet
from megatron_hybrid.modules.fast.mamba import FastTorchMambaMixer
from megatron_hybrid.modules.fast.mla import FastMLASelfAttention
from megatron_hybrid.modules.gated_delta_net import HybridGatedDeltaNet
from megatron_hybrid.modules.mamba_torch import TorchMambaMixer
from megatron_hybrid.modules.mla import HybridMLASelfAttention

__all__ = ["FAST_CLASSES", "fast_layer_specs"]

#: Reference class of the ``local`` backend -> its fast subclass.
FAST_CLASSES: dict[type, type] = {
    SelfAttention: FastSelfAttention,
    LocalCoreAttention: SDPACoreAttention,
    MLACoreAttention: SDPAMLACoreAttention,
    HybridMLASelfAttention: FastMLASelfAttention,
    SequentialMLP: GroupedGemmExperts,
    MoELayer: FastMoELayer,
    HybridGatedDeltaNet: FastGatedDeltaNet,
    TorchMambaMixer: FastTorchMambaMixer,
}


def _swap(obj: Any, table: dict[type, type]) -> Any:
    if isinstance(obj, type):
        return table.get(obj, obj)
    if isinstance(obj, ModuleSpec):
        params = {k: _swap(v, table) for k, v in (obj.params or {}).items()}
        return dataclasses.replace(
            obj, module=_swap(obj.module, table), submodules=_swap(obj.submodules, table),
            params=params,
        )  # fmt: skip
    if isinstance(obj, functools.partial):
        return functools.partial(
            _swap(obj.func, table),
            *(_swap(a, table) for a in obj.args),
            **{k: _swap(v, table) for k, v in obj.keywords.items()},
        )
    if dataclasses.is_dataclass(obj):
        changes = {f.name: _swap(getattr(obj, f.name), table) for f in dataclasses.fields(obj)
                   if f.init}  # fmt: skip
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return {k: _swap(v, table) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap(v, table) for v in obj)
    return obj


def fast_layer_specs(layers: dict[str, Any]) -> dict[str, Any]:
    """``layers`` (a backend's ``HybridStackSubmodules`` fields) with every reference class of
    :data:`FAST_CLASSES` replaced by its fast subclass; the input is not modified."""
    return {name: _swap(spec, FAST_CLASSES) for name, spec in layers.items()}

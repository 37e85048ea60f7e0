"""HybridEP-aligned sequence padding for padded (BSHD) and packed (THD) batches.

Planners (pure Python, importing this package imports no torch): :func:`seq_divisible_by`,
:func:`bshd_pad`, :func:`thd_pack`, :func:`group_equalize`, plus :func:`padding_config_from` and
:func:`thd_unsupported_reason`. Tensor appliers (:func:`pad_bshd`, :func:`pack_thd`, ...) and the
equal-count collective (:func:`equalize_bshd`, :func:`equalize_thd`) load torch and megatron-core
on first access.

>>> from megatron_hybrid.padding import bshd_pad
>>> plan = bshd_pad(cur_len=1000, batch_size=2, tp=2, cp=1, sp=True, hybridep=True)
>>> plan.padded_len, plan.breakdown
(1024, {'tp_split': 2, 'hybridep': 128})
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_hybrid.padding.config import PaddingConfig, padding_config_from
from megatron_hybrid.padding.layout_support import (
    thd_unsupported_reason,
    thd_unsupported_reason_for,
)
from megatron_hybrid.padding.multiples import (
    CHUNK_ENV_VAR,
    DEFAULT_HYBRIDEP_CHUNK,
    FORCE_POLICIES,
    QUANT_ALIGN,
    BshdPlan,
    Constraint,
    bshd_pad,
    group_equalize,
    hybridep_chunk,
    quant_align,
    seq_divisible_by,
)
from megatron_hybrid.padding.thd import THD_MODES, ThdPlan, thd_pack

# Torch-backed names, loaded lazily so that planning stays import-light.
_LAZY = {
    "IGNORE_INDEX": "batch",
    "PackedBatch": "batch",
    "PaddedBatch": "batch",
    "pack_thd": "batch",
    "pad_bshd": "batch",
    "packed_seq_params_from": "batch",
    "packed_seq_params_to": "batch",
    "unpack_thd": "batch",
    "unpad_seq": "batch",
    "equalize_bshd": "equalize",
    "equalize_thd": "equalize",
    "extend_bshd": "equalize",
    "extend_thd": "equalize",
}

# The public surface of megatron_hybrid.padding.
__all__ = [
    "CHUNK_ENV_VAR",
    "DEFAULT_HYBRIDEP_CHUNK",
    "FORCE_POLICIES",
    "QUANT_ALIGN",
    "THD_MODES",
    "BshdPlan",
    "Constraint",
    "PaddingConfig",
    "ThdPlan",
    "bshd_pad",
    "group_equalize",
    "hybridep_chunk",
    "padding_config_from",
    "quant_align",
    "seq_divisible_by",
    "thd_pack",
    "thd_unsupported_reason",
    "thd_unsupported_reason_for",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

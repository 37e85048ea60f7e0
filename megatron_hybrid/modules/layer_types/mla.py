"""Runtime of ``+`` (multi-latent attention): an attention half of a GPT layer."""

from __future__ import annotations

from megatron_hybrid.modules.layer_types.common import attention_half_runtime
from megatron_hybrid.pattern import MLA

RUNTIME = attention_half_runtime(
    MLA,
    "mla_layer",
    unverified="multi-latent attention has not been verified under CUDA graph capture",
)

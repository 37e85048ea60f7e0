"""Runtime of ``D`` (DeepSeek sparse attention): an attention half of a GPT layer."""

from __future__ import annotations

from megatron_hybrid.modules.layer_types.common import attention_half_runtime
from megatron_hybrid.pattern import DSA

RUNTIME = attention_half_runtime(
    DSA,
    "dsa_layer",
    unverified="DeepSeek sparse attention has not been verified under CUDA graph capture",
)

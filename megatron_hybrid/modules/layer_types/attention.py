"""Runtime of ``*`` (attention): the attention half of a GPT ``TransformerLayer``."""

from __future__ import annotations

from megatron_hybrid.modules.layer_types.common import attention_half_runtime
from megatron_hybrid.pattern import ATTENTION

RUNTIME = attention_half_runtime(ATTENTION, "attention_layer")

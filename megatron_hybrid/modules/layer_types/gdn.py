"""Runtime of ``G`` (GatedDeltaNet): a ``TransformerLayer`` whose ``self_attention`` is GDN.

megatron-core builds GatedDeltaNet as the attention half of a ``TransformerLayer`` without the
attention-only constructor arguments; it runs like one in the pre-dispatch slot.
"""

from __future__ import annotations

from megatron_hybrid.modules.layer_types.common import attention_half_runtime
from megatron_hybrid.pattern import GDN

RUNTIME = attention_half_runtime(GDN, "gdn_layer", attention=False)

"""Runtime of ``G`` (GatedDeltaNet): a ``TransformerLayer`` whose ``self_attention`` is GDN.

megatron-core builds GatedDeltaNet as the attention half of a ``TransformerLayer`` without the
attention-only constructor arguments; it runs like one in the pre-dispatch slot.
"""

from __future__ import annotations

from megatron_hybrid.modules.flops import SequenceBatch, linear_flops
from megatron_hybrid.modules.layer_types.common import attention_half_runtime
from megatron_hybrid.pattern import GDN

#: Steps per chunk of the chunked delta rule (fla's kernels and megatron's torch path).
CHUNK = 64


def flops(config, batch: SequenceBatch) -> dict[str, float]:
    """Forward FLOPs: input projection (q, k, v, output gate, beta, alpha), depthwise causal
    conv, the chunked delta rule per value head, output projection.

    Per value head and chunk of ``C`` steps (keys shared across value heads are counted per
    value head, as the kernels expand them): the strictly lower ``K_beta K^T`` (``C (C-1) dk``),
    the unit-triangular inverse (``C^3 / 3``), ``W = T K_beta e^g`` and ``U = T V_beta``
    (lower-triangular, ``C (C+1) (dk + dv)``), the state read by ``W`` and by the queries and
    the state update (``3 x 2 C dk dv``), causal ``Q K^T`` and its product with the corrected
    values (``C (C+1) (dk + dv)``).
    """
    tokens, hidden = batch.tokens, config.hidden_size
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    qk_width, v_width = key_heads * dk, value_heads * dv
    c = CHUNK
    per_token = (c - 1) * dk + c * c / 3 + (c + 1) * (dk + dv) + 6 * dk * dv + (c + 1) * (dk + dv)
    return {
        "in_proj": linear_flops(tokens, hidden, 2 * qk_width + 2 * v_width + 2 * value_heads),
        "conv": 2 * tokens * (2 * qk_width + v_width) * config.linear_conv_kernel_dim,
        "delta_rule": tokens * value_heads * per_token,
        "out_proj": linear_flops(tokens, v_width, hidden),
    }


RUNTIME = attention_half_runtime(GDN, "gdn_layer", attention=False, flops=flops)

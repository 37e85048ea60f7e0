"""The small MLA config of the CPU tests: a ``TransformerConfig`` made an ``MLATransformerConfig``.

Query/key heads of 16 + 8 (RoPE) dimensions, value heads of 16 (so packed rows pad the values,
as megatron-core does for THD), latent rank 32, no query down-projection, plain RoPE.
"""

from __future__ import annotations

import dataclasses

__all__ = ["mla_config"]


def mla_config(config, **changes):
    """``config`` (any ``TransformerConfig``) with the small MLA fields, then ``changes``."""
    from megatron.core.transformer import MLATransformerConfig

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields.update(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16,
                  qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope")  # fmt: skip
    fields.update(changes)
    return MLATransformerConfig(**fields)

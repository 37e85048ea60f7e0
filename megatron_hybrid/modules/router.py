"""megatron-core's top-k router with its expert-bias token count fixed for padded batches.

megatron-core 0.19.2's ``TopKRouter.routing`` flattens ``padding_mask`` to ``[tokens]`` and
``_apply_expert_bias`` then computes ``routing_map & ~padding_mask`` with ``routing_map`` of
shape ``[tokens, experts]`` (``megatron/core/transformer/moe/router.py``): the mask broadcasts
along the expert axis, so any padded batch fails (``size of tensor a (experts) must match the
size of tensor b (tokens)``) in a training step of a router with ``moe_router_enable_expert_bias``
(DeepSeek-V3, Nemotron-H). The MoE specs of this package use this subclass, which masks each
token's whole row as intended; everything else is megatron-core's.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter

__all__ = ["PaddingAwareTopKRouter"]


class PaddingAwareTopKRouter(TopKRouter):
    """``TopKRouter`` whose expert-bias token count leaves padding tokens out (see module doc)."""

    def _apply_expert_bias(
        self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> None:
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1, 1)  # one flag per token, for every expert
        super()._apply_expert_bias(routing_map, padding_mask=padding_mask)

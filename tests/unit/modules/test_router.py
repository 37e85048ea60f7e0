"""The MoE router's expert-bias token count under a padded batch (megatron-core 0.19.2 fix)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_hybrid.modules.router import PaddingAwareTopKRouter
from megatron_hybrid.testing.models import small_config

TOKENS, EXPERTS = 6, 4


def _router(cls, pg):
    config = small_config(
        "[*E]",
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32",
    )
    return cls(config=config, pg_collection=pg)


def _routing():
    routing_map = torch.rand(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(0)) < 0.5
    padding_mask = torch.tensor([[False, False, True], [False, True, True]])  # [b, s], True = pad
    return routing_map, padding_mask


def test_padding_tokens_are_left_out_of_the_expert_load(pg):
    router = _router(PaddingAwareTopKRouter, pg)
    routing_map, padding_mask = _routing()
    with torch.enable_grad():
        router._apply_expert_bias(routing_map, padding_mask=padding_mask.reshape(-1))
    real = ~padding_mask.reshape(-1)
    expected = routing_map[real].sum(dim=0).to(router.local_tokens_per_expert.dtype)
    assert torch.equal(router.local_tokens_per_expert, expected)
    assert router.local_tokens_per_expert.sum() < routing_map.sum()  # some pads were routed


def test_megatron_core_router_fails_on_the_same_batch(pg):
    """The negative control: the upstream method broadcasts the token mask over experts."""
    router = _router(TopKRouter, pg)
    routing_map, padding_mask = _routing()
    with torch.enable_grad(), pytest.raises(RuntimeError, match="must match the size"):
        router._apply_expert_bias(routing_map, padding_mask=padding_mask.reshape(-1))

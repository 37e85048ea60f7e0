"""Checkpoint keys of hybrid stacks (pure key rules; sharded-state-dict wiring in ``sharded``).

Only the pure key rules are imported here, so ``import megatron_hybrid.checkpointing`` stays free
of torch; import ``megatron_hybrid.checkpointing.sharded`` for the state-dict wiring.
"""

from megatron_hybrid.checkpointing.keys import (
    decoder_layer_prefix,
    final_norm_prefix,
    mtp_layer_prefix,
)

__all__ = ["decoder_layer_prefix", "final_norm_prefix", "mtp_layer_prefix"]

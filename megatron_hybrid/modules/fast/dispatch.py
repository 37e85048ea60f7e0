"""Token dispatch without a host synchronisation where no tokens leave the GPU.

megatron-core 0.19.2's all-to-all dispatcher (``MoEAlltoAllTokenDispatcher``) copies the token
counts to the host in every MoE forward and waits for them (``_maybe_dtoh_and_synchronize``):
with several local experts and no fused permutation it waits before its second permutation,
which sorts the received chunks by local expert. With one expert-parallel and one
expert-tensor-parallel rank nothing is received, that sort is the identity (``tp * ep`` chunks
of one), and the wait only drains the GPU's queue once per MoE layer and micro-batch: the host
then refills an empty GPU launch by launch. (With EP > 1 the all-to-all needs its split sizes
on the host, so the copy and the wait stay; they cost the same as in GPTModel.)

:class:`SyncFreeAllToAllDispatcher` skips the copy, the wait and the identity sorts where
:func:`~megatron_hybrid.modules.fast.selection.sync_free_dispatch_reason` says nothing needs
them, and hands the experts their token counts on the device (``GroupedGemmExperts`` uses them
there; ``SequentialMLP`` still reads them on the host). Its first permutation (megatron's
argsort-based ``permute``) and the unpermutation are already loop-free and sync-free.
:class:`FastMoELayer` is megatron's ``MoELayer`` with this dispatcher.
"""

from __future__ import annotations

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_hybrid.modules.fast.selection import sync_free_dispatch_reason

__all__ = ["FastMoELayer", "SyncFreeAllToAllDispatcher"]


class SyncFreeAllToAllDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher without its host copy where no rank exchanges tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast_path_reason = sync_free_dispatch_reason(self)

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
        if self.fast_path_reason is None:
            return tokens_per_expert  # stays on the device; nothing on the host needs it
        return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """Tokens, their counts per local expert and their probabilities, for the experts."""
        if self.fast_path_reason is not None:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        # tp * ep == 1: the received chunks are already in local-expert order.
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        """Expert outputs in the order the combine expects (here: as they are)."""
        if self.fast_path_reason is not None:
            return super().combine_preprocess(hidden_states)
        return hidden_states


class FastMoELayer(MoELayer):
    """megatron-core's ``MoELayer`` whose all-to-all dispatcher skips needless host copies."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            pg_collection=pg_collection,
            **kwargs,
        )
        if type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher:
            if pg_collection is None:  # as MoELayer resolves it
                from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

                pg_collection = get_default_pg_collection()
            dispatcher = SyncFreeAllToAllDispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=self.config,
                pg_collection=pg_collection,
            )
            if self.use_shared_expert and self.shared_expert_overlap:
                dispatcher.set_shared_experts(self.shared_experts)
            self.token_dispatcher = dispatcher

    @property
    def fast_path_reason(self) -> str | None:
        """Why the dispatcher copies token counts to the host (None: it does not)."""
        return getattr(self.token_dispatcher, "fast_path_reason", "not megatron's all-to-all")

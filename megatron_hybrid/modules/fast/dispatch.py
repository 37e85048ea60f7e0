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
there; ``SequentialMLP`` still reads them on the host). At any EP size it permutes the tokens
before the all-to-all and unpermutes them after it with gathers
(:mod:`~megatron_hybrid.modules.fast.permutation`) instead of megatron's atomic adds, where
:func:`~megatron_hybrid.modules.fast.selection.gather_permutation_reason` allows it; the rows are
in megatron's order either way. At EP > 1 it sorts the received chunks by local expert, and back
before the combine, with one gather each
(:func:`~megatron_hybrid.modules.fast.permutation.chunk_order`) instead of megatron's split and
concatenation of ``ranks x local experts`` pieces, where
:func:`~megatron_hybrid.modules.fast.selection.chunk_sort_reason` allows it. :class:`FastMoELayer`
is megatron's ``MoELayer`` with this dispatcher.
"""

from __future__ import annotations

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_hybrid.modules.fast.permutation import (
    chunk_order,
    inverse_order,
    permutation_map,
    permute_probs,
    permute_tokens,
    reorder_rows,
    unpermute_tokens,
)
from megatron_hybrid.modules.fast.selection import (
    chunk_sort_reason,
    gather_permutation_reason,
    sync_free_dispatch_reason,
)

__all__ = ["FastMoELayer", "SyncFreeAllToAllDispatcher"]


class SyncFreeAllToAllDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher without its host copy where no rank exchanges tokens,
    permuting with gathers.

    ``fast_path_reason`` says why it copies token counts to the host (None: it does not),
    ``permutation_reason`` why it permutes with megatron's ``permute`` (None: with gathers),
    ``chunk_sort_reason`` why it sorts received chunks with megatron's split and concatenation
    (None: with a gather, or nothing to sort).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast_path_reason = sync_free_dispatch_reason(self)
        self.permutation_reason = gather_permutation_reason(self)
        # Chunks from other ranks to sort: EP > 1 and several local experts.
        to_sort = self.ep_size > 1 and self.num_local_experts > 1
        self.chunk_sort_reason = chunk_sort_reason(self) if to_sort else None
        self._sorts_chunks = to_sort and self.chunk_sort_reason is None
        self._permutation = None
        self._chunk_counts = None  # [ranks, local experts] on the device, until the dispatch
        self._chunk_orders = None  # (restore, sort) from the dispatch to the combine

    def preprocess(self, routing_map):
        """megatron's, keeping the chunks' counts on the device for :func:`chunk_order` (megatron
        moves its copy to the host before the all-to-all)."""
        tokens_per_local_expert = super().preprocess(routing_map)
        if self._sorts_chunks:
            self._chunk_counts = self.num_global_tokens_per_local_expert
        return tokens_per_local_expert

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """Tokens and probabilities permuted for the all-to-all (megatron's contract)."""
        if self.permutation_reason is not None:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        # The steps of megatron's dispatch_preprocess without router padding (excluded by
        # gather_permutation_reason), its permute replaced by gathers.
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_permutation_1", self.tokens_per_expert
        )
        self.hidden_shape_before_permute = hidden_states.shape
        mapping = permutation_map(routing_map, self.config.moe_router_topk)
        self._permutation = mapping
        self.reversed_local_input_permutation_mapping = mapping.row_token
        return permute_tokens(hidden_states, mapping), permute_probs(probs, mapping)

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
        if self.fast_path_reason is None:
            return tokens_per_expert  # stays on the device; nothing on the host needs it
        return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """Tokens, their counts per local expert and their probabilities, for the experts."""
        if self._sorts_chunks:
            # megatron's steps for expert tensor parallelism 1, its sort replaced by a gather.
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
                "before_permutation_2", self.tokens_per_expert
            )
            counts, self._chunk_counts = self._chunk_counts, None
            rows = global_input_tokens.shape[0]
            order = chunk_order(counts, rows)
            restore = inverse_order(order)
            self._chunk_orders = (restore, order)
            tokens = reorder_rows(global_input_tokens, order, restore)
            probs = reorder_rows(global_probs, order, restore)
            tokens_per_expert = self._maybe_dtoh_and_synchronize(
                "before_finish", self.tokens_per_expert
            )
            self.tokens_per_expert = None
            return tokens, tokens_per_expert, probs
        if self.fast_path_reason is not None:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        # tp * ep == 1: the received chunks are already in local-expert order.
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        """Expert outputs in the order the combine expects."""
        if self._sorts_chunks:
            (restore, order), self._chunk_orders = self._chunk_orders, None
            return reorder_rows(hidden_states, restore, order)
        if self.fast_path_reason is not None:
            return super().combine_preprocess(hidden_states)
        return hidden_states  # tp * ep == 1: as they are

    def combine_postprocess(self, permutated_local_input_tokens):
        """Each token's rows summed back into its place, plus the shared experts' output."""
        if self.permutation_reason is not None:
            return super().combine_postprocess(permutated_local_input_tokens)
        mapping, self._permutation = self._permutation, None
        output = unpermute_tokens(permutated_local_input_tokens, mapping)
        output = output.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output


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
        """Why the dispatcher copies token counts to the host, permutes with megatron's atomic
        adds or sorts received chunks by splitting them (None: none of them)."""
        dispatcher = self.token_dispatcher
        names = ("fast_path_reason", "permutation_reason", "chunk_sort_reason")
        reasons = [getattr(dispatcher, name, "not megatron's all-to-all") for name in names]
        found = [r for r in dict.fromkeys(reasons) if r is not None]
        return "; ".join(found) if found else None

"""Where megatron's DDP buffer puts each parameter: the routed experts' weights in expert order.

megatron-core 0.19.2 lays a chunk's trainable parameters into its contiguous buffers in reverse
registration order, the order the backward produces gradients (``distributed/
param_and_grad_buffer.py`` ``_compute_default_per_buffer_param_layout`` and ``optimizer/
distrib_optimizer.py`` ``_compute_per_buffer_param_layout`` both walk ``params[::-1]``), and the
parameters and their ``main_grad`` become views of those buffers. ``SequentialMLP`` registers
``local_experts.{e}.linear_fc1`` and ``linear_fc2`` expert after expert, so one linear's expert
weights end up at decreasing addresses, interleaved with the other linear's. No view stacks them:
the fast path's grouped GEMM (``modules/fast/grouped_linear.py``) copied them into a stack in
every forward and backward (at ``benchmarks/mfu.py``'s issue shape 128 copies of 268 MB a step,
12 ms of an H200's time, 2026-11-28), and its weight-gradient add checked and looked up every
destination address in each backward.

:data:`EXPERTS_ORDER` places every ``SequentialMLP``'s expert weights together where megatron's
walk meets the first of them: ``linear_fc1`` of every local expert in expert order, then
``linear_fc2`` likewise. Everything else keeps megatron's place. The layout goes to DDP as its
``full_param_layout``, computed by megatron's own layout functions on the reordered list, so
padding and buckets follow megatron's rules; parameters, ``main_grad`` and the distributed
optimizer's shards follow the buffer. Chunks whose gradients reduce during the backward
(``overlap_grad_reduce``) keep megatron's order: there the buffer order is the order buckets
become ready in.

The order is part of a checkpoint of the distributed optimizer: its ``dp_reshardable`` state is
the buffer, flattened, and would load into another order without an error and with each
moment on another parameter. So a checkpoint records its chunks' order (:data:`COMMON_KEY` in
the common state; absent: megatron's, which every checkpoint written before this order existed
used), ``train`` builds a resumed run's chunks in the order of the checkpoint it resumes
(:func:`order_to_resume`), and ``load_checkpoint`` refuses a mismatch before it loads
(:func:`check_order`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_hybrid.checkpointing.store import read_common

__all__ = [
    "COMMON_KEY",
    "EXPERTS_ORDER",
    "MEGATRON_ORDER",
    "ORDERS",
    "OrderMismatchError",
    "buffer_layout",
    "check_order",
    "chunk_order",
    "expert_blocks",
    "mark_chunk",
    "order_to_resume",
    "ordered_for_buffer",
    "saved_order",
]

#: megatron-core's own order (reverse registration order).
MEGATRON_ORDER = "megatron"
#: megatron's, with each ``SequentialMLP``'s expert weights together, per linear in expert order.
EXPERTS_ORDER = "experts"
ORDERS = (MEGATRON_ORDER, EXPERTS_ORDER)
#: The checkpoint's common-state entry with the order its chunks were built in.
COMMON_KEY = "param_order"
#: The attribute :func:`~megatron_hybrid.training.loop.wrap_model_chunks` sets on each chunk.
_CHUNK_ATTRIBUTE = "param_order"
_LINEARS = ("linear_fc1", "linear_fc2")


class OrderMismatchError(ValueError):
    """A checkpoint's optimizer state was laid out in another buffer order than the chunks'."""


def expert_blocks(module: torch.nn.Module, params) -> list[list[torch.nn.Parameter]]:
    """Each ``SequentialMLP``'s expert weights in the order :data:`EXPERTS_ORDER` lays them out.

    A block is ``linear_fc1`` of every local expert, then ``linear_fc2``. A linear whose weights
    are not all among ``params`` (frozen under LoRA, say) or differ in dtype or expert-parallel
    placement (what picks megatron's buffer) is left out: its weights keep megatron's place.
    """
    trainable = {id(p) for p in params}
    blocks = []
    for sub in module.modules():
        if not isinstance(sub, SequentialMLP) or len(sub.local_experts) < 2:
            continue
        block = []
        for name in _LINEARS:
            # A linear an adapter wraps may have no weight of its own: it keeps its place.
            weights = [getattr(getattr(e, name, None), "weight", None) for e in sub.local_experts]
            first = weights[0]
            same = all(
                isinstance(w, torch.nn.Parameter)
                and id(w) in trainable
                and w.dtype == first.dtype
                and getattr(w, "allreduce", True) == getattr(first, "allreduce", True)
                for w in weights
            )
            if same:
                block.extend(weights)
        if block:
            blocks.append(block)
    return blocks


def ordered_for_buffer(params, blocks) -> list:
    """``params`` (DDP's order) rearranged so that megatron's reversed walk meets each block's
    weights together and in the block's order, where it met the block's first weight."""
    member = {id(p): index for index, block in enumerate(blocks) for p in block}
    walk, placed = [], set()
    for param in reversed(params):
        index = member.get(id(param))
        if index is None:
            walk.append(param)
        elif index not in placed:
            placed.add(index)
            walk.extend(blocks[index])
    return walk[::-1]


def buffer_layout(module: torch.nn.Module, config, ddp_config, pg_collection, order: str):
    """megatron's ``FullParamLayout`` of ``module``'s buffers in ``order``; None where it is
    megatron's own (``order`` is :data:`MEGATRON_ORDER`, no expert block, or gradients reduced
    during the backward).

    Args:
        module: the model chunk DDP will wrap.
        config: its ``TransformerConfig``.
        ddp_config: the ``DistributedDataParallelConfig`` DDP will get.
        pg_collection: the process groups DDP will get.
        order: one of :data:`ORDERS`.
    """
    if order not in ORDERS:
        raise ValueError(f"parameter order {order!r} is not one of {ORDERS}")
    if order == MEGATRON_ORDER or ddp_config.overlap_grad_reduce:
        return None
    from megatron.core.distributed.param_and_grad_buffer import (
        _compute_default_per_buffer_param_layout,
        group_params_for_buffers,
    )
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.param_layout import FullParamLayout
    from megatron.core.process_groups_config import ProcessGroupCollection

    # DDP's own list (distributed_data_parallel.py): trainable parameters, registration order.
    params = [p for p in module.parameters() if p.requires_grad]
    blocks = expert_blocks(module, params)
    if not blocks:
        return None
    ordered = ordered_for_buffer(params, blocks)
    if ddp_config.use_distributed_optimizer:
        groups = ProcessGroupCollection.setup_process_groups_for_ddp(
            pg_collection, config, ddp_config
        )
        # Without overlap_grad_reduce DDP has no buckets (bucket_size None), as here.
        layout = DistributedOptimizer.compute_full_param_layout(
            ordered,
            None,
            groups["intra_dp_cp_group"].size(),
            ddp_config,
            expert_data_parallel_world_size=groups["intra_expt_dp_group"].size(),
        )
    else:
        grouped = group_params_for_buffers(ordered, ddp_config.grad_reduce_in_fp32)
        layout = FullParamLayout(
            {key: _compute_default_per_buffer_param_layout(group, None)
             for key, (group, _) in grouped.items()}
        )  # fmt: skip
    # DDP checks each buffer's param_indices (a parameter's rank among those of its dtype, in
    # DDP's order, read for FP8 checkpoints) against its own grouping: they do not move.
    own = group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32)
    for key, (_, indices) in own.items():
        layout.layouts[key].param_indices = indices
    return layout


def chunk_order(chunks) -> str:
    """The order the chunks' buffers were built in (all chunks share one)."""
    orders = {getattr(chunk, _CHUNK_ATTRIBUTE, MEGATRON_ORDER) for chunk in chunks}
    if len(orders) != 1:
        raise ValueError(f"model chunks were built in different parameter orders: {orders}")
    return orders.pop()


def mark_chunk(chunk, order: str) -> None:
    """Record on ``chunk`` the order its buffers were built in."""
    setattr(chunk, _CHUNK_ATTRIBUTE, order)


def saved_order(common: Mapping) -> str:
    """The order a checkpoint's chunks were built in (megatron's where none is recorded)."""
    return common.get(COMMON_KEY, MEGATRON_ORDER)


def order_to_resume(folder) -> str:
    """The order to build a run's chunks in: that of the checkpoint ``folder`` it resumes (its
    distributed-optimizer state loads only into that order; other optimizers' state does not
    depend on it), :data:`EXPERTS_ORDER` for a run that resumes nothing (``folder`` None)."""
    return EXPERTS_ORDER if folder is None else saved_order(read_common(folder))


def check_order(common: Mapping, folder, chunks) -> None:
    """Refuse, before loading, distributed-optimizer state saved in another buffer order.

    Raises:
        OrderMismatchError: with both orders and what to do.
    """
    distributed = any(
        getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False)
        for chunk in chunks
    )
    saved, now = saved_order(common), chunk_order(chunks)
    if distributed and saved != now:
        raise OrderMismatchError(
            f"{folder} holds distributed-optimizer state of parameters laid out in the "
            f"{saved!r} order, these model chunks are in the {now!r} order; build them with "
            f"wrap_model_chunks(..., param_order={saved!r}) (train does so when it resumes), "
            "or load the model weights alone (the experts of another spec, such as "
            "TransformerEngine's grouped MLP, are laid out in megatron's order only)"
        )

"""One expert linear of every local expert as grouped GEMMs, with one weight-gradient add.

The experts keep ``SequentialMLP``'s parameters (one weight per expert and linear: their
checkpoint keys, optimizer layout and LoRA targets are megatron's), so the grouped GEMM needs
their weights stacked (``[E, out, in]``) and autograd would hand each expert its own slice of
the stacked weight gradient. Through ``torch.stack``'s backward that is one gradient per expert
and linear, which autograd then adds to the expert's ``.grad`` (or megatron's DDP hook to its
``main_grad``) one kernel at a time: 64 experts, 2 linears, 4 layers and 8 micro-batches are
4,096 small add kernels and their launches per step. :class:`GroupedLinearFunction` computes
the input gradient and the stacked weight gradient with one grouped GEMM each and accumulates
the weight gradient itself:

* **megatron's DistributedDataParallel** (the parameters have ``main_grad``): into
  ``main_grad``, as megatron-core 0.19.2's ``LinearWithGradAccumulationAndAsyncCommunication``
  does with ``gradient_accumulation_fusion`` (``tensor_parallel/layers.py``): it sets
  ``grad_added_to_main_grad`` and returns a placeholder gradient, so DDP's per-parameter hooks
  still run (``overlap_grad_reduce`` counts them) and add nothing (``zero_out_wgrad``: zeros,
  which they add). Where DDP does not overlap the reduction its hook only clears ``.grad``
  (megatron-core 0.19.2, ``DistributedDataParallel._make_backward_post_hook``); chunks marked
  by :func:`mark_idle_grad_hooks` then get no gradient at all, which spares autograd's
  accumulator and the hook for every expert weight (64 experts, 2 linears, 4 layers and 8
  micro-batches: 4,096 of each, about 70 ms of host time in a step on one H200). On CUDA one
  Triton GEMM multiplies and adds into every expert's float32 ``main_grad``
  (:mod:`~megatron_hybrid.modules.fast.grouped_wgrad`); elsewhere the grouped GEMM's bfloat16
  stack is added by one kernel (:func:`~megatron_hybrid.modules.fast.grouped_add.grouped_add_`);
* **plain autograd**: the first micro-batch's stacked gradient becomes the experts' ``.grad``
  (each a view of it); later micro-batches add into that stack with one kernel and hand the
  same views back, so autograd's accumulator (and any post-accumulate hook) still sees every
  expert's gradient, with nothing left to add. Gradients that are not such views (set
  elsewhere), weights with a gradient hook (it must see the micro-batch's gradient, not the
  sum) and passes that do not accumulate into ``.grad`` (``torch.autograd.grad``,
  ``backward(inputs=...)`` without the weights) get autograd's own per-expert handling.
  (The ``main_grad`` add above happens in any backward pass, as megatron's fused linear's
  does: CUDA-graph capture records it through ``torch.autograd.grad``.)

Weights that require no gradient (frozen under LoRA) get no weight-gradient GEMM. Weights that
already lie evenly spaced in one storage are multiplied in place, without the stacking copy; the
experts put theirs there when they are built (:func:`pack_weights`).
A stack that is a copy is not saved for the backward pass, which stacks the weights again (one
more copy kernel per linear): saved, it would hold a second copy of every local expert weight
from each forward to its backward, for every micro-batch in flight (all MoE layers at the end
of a forward; times the in-flight micro-batches of a pipeline stage), where megatron's
``SequentialMLP`` and TransformerEngine's grouped linear keep only the parameters.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.graph import get_gradient_edge

from megatron_hybrid.modules.fast.grouped_add import grouped_add_, stacked_view
from megatron_hybrid.modules.fast.grouped_wgrad import (
    grouped_wgrad_into_main_grads,
    grouped_wgrad_reason,
)

__all__ = [
    "GroupedLinearFunction",
    "grouped_linear",
    "mark_idle_grad_hooks",
    "pack_weights",
    "stack_weights",
]

#: The parameter attribute :func:`mark_idle_grad_hooks` sets.
_IDLE_HOOK = "ddp_grad_hook_idle"


def mark_idle_grad_hooks(chunk) -> None:
    """Mark the parameters of a megatron ``DistributedDataParallel`` chunk whose gradient hook
    has nothing to do once a gradient is in ``main_grad``: without ``overlap_grad_reduce`` it
    only adds a gradient not yet added and clears ``.grad`` (megatron-core 0.19.2,
    ``_make_backward_post_hook``), so the grouped experts hand such weights no gradient.
    With ``overlap_grad_reduce`` the hook counts gradients for its buckets: nothing is marked.
    """
    idle = not chunk.ddp_config.overlap_grad_reduce
    for param in chunk.module.parameters():
        setattr(param, _IDLE_HOOK, idle)


def stack_weights(weights) -> torch.Tensor:
    """The ``[E, out, in]`` stack of the expert weights, outside autograd: a view where
    :func:`stacked_view` finds one, else one copy. Made under ``no_grad``, nothing records the
    stack, so the weights need no detach each (256 experts: 256 operators fewer per linear)."""
    with torch.no_grad():
        view = stacked_view(weights)
        return view if view is not None else torch.stack(weights)


def pack_weights(weights) -> bool:
    """Move the weights (parameters of one shape, dtype and device) into one storage, in order,
    so that :func:`stack_weights` is a view and no forward copies them; True if it moved them.

    Only ``.data`` changes: each weight stays its own parameter, under its own name, with its
    own gradient. Whatever later gives the parameters new storage (``module.to`` a copy,
    megatron's DDP buffer in megatron's own order) undoes the packing; the grouped GEMM then
    stacks them again on every call, one copy per linear (256 experts of a Qwen3.5-MoE layer's
    ``linear_fc1``: 1 GiB in bf16, copied per micro-batch). ``train``'s DDP buffers keep them in
    order (``training/param_order.py``).
    """
    if len(weights) < 2 or stacked_view(weights) is not None:
        return False
    first = weights[0]
    same = all(w.shape == first.shape and w.dtype == first.dtype and w.device == first.device
               and w.is_contiguous() and type(w) is type(first) for w in weights)  # fmt: skip
    if not same or first.device.type == "meta":
        return False
    with torch.no_grad():
        stack = stack_weights(weights)
    for weight, row in zip(weights, stack, strict=True):
        weight.data = row
    return True


@functools.cache
def _zeroes_empty_groups(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` on ``device`` may leave an empty group's weight gradient
    unwritten: on Blackwell (compute capability 10.x) a group without rows has been seen to get
    non-zero gradients (pytorch/pytorch issue 172439); Hopper writes zeros."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    """A zero gradient shaped like ``weight`` for megatron DDP's hooks (which drop it).

    Each call returns a fresh tensor object over one cached buffer (as TransformerEngine's
    ``get_dummy_wgrad`` reuses one), so autograd's accumulator adopts it without a copy."""
    key = (tuple(weight.shape), weight.dtype, weight.device)
    buffer = _PLACEHOLDERS.get(key)
    if buffer is None:
        buffer = torch.zeros_like(weight, memory_format=torch.contiguous_format)
        _PLACEHOLDERS[key] = buffer
    return buffer.detach()


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


class GroupedLinearFunction(torch.autograd.Function):
    """``tokens[rows of e] @ W_e^T`` for every expert ``e``, gradients as the module doc says.

    ``forward(ctx, tokens, offsets, untracked, *weights)``: ``tokens`` ``[rows, in]`` sorted by
    expert, ``offsets`` ``[E]`` int32 end offsets of each expert's rows, ``weights`` the ``E``
    expert weights ``[out, in]``; returns ``[rows, out]``. ``untracked``: None, or the weights
    themselves (then ``weights`` is empty) where autograd should not know them: their
    gradients go into ``main_grad`` only, no node of theirs runs (see
    :func:`mark_idle_grad_hooks`).
    """

    @staticmethod
    def forward(ctx, tokens, offsets, untracked, *weights):
        weights = untracked if untracked is not None else weights
        stacked = stack_weights(weights)
        out = torch._grouped_mm(tokens, stacked.transpose(1, 2), offs=offsets)
        # A view of the parameters is saved (autograd checks it was not changed in place); a
        # copy is made again in the backward (see the module doc), with the same check.
        view = stacked.untyped_storage().data_ptr() == weights[0].untyped_storage().data_ptr()
        ctx.save_for_backward(tokens, offsets, stacked if view else None)
        ctx.versions = None if view else [w._version for w in weights]
        ctx.weights = weights
        ctx.untracked = untracked is not None
        # As megatron's linear: main_grad is read at forward (a module may be called again,
        # e.g. by an MTP depth, before this backward runs).
        main_grads = [getattr(w, "main_grad", None) for w in weights]
        fsdp = any(hasattr(w, "__fsdp_param__") for w in weights)
        ctx.main_grads = None if fsdp or any(g is None for g in main_grads) else main_grads
        if ctx.untracked and ctx.main_grads is None:
            raise RuntimeError(
                "grouped experts: weights marked by mark_idle_grad_hooks have no main_grad (or "
                "are FSDP parameters); mark only megatron DistributedDataParallel chunks"
            )
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        tokens, offsets, stacked = ctx.saved_tensors
        weights = ctx.weights
        wanted = (True,) * len(weights) if ctx.untracked else ctx.needs_input_grad[3:]
        none = [] if ctx.untracked else [None] * len(weights)
        grad_out = grad_out.contiguous()
        grad_tokens = None
        if ctx.needs_input_grad[0]:
            if stacked is None:
                _check_versions(weights, ctx.versions)
                stacked = stack_weights(weights)
            grad_tokens = torch._grouped_mm(grad_out, stacked, offs=offsets)
        ctx.weights = None
        if not any(wanted):
            return (grad_tokens, None, None, *none)
        main_grads = ctx.main_grads
        if main_grads is not None and _fused_into_main_grads(grad_out, tokens, offsets, main_grads):
            grad_weight = None  # multiplied and added into main_grad by one kernel
        else:
            # [E, out, in]: the contraction runs over each expert's rows.
            grad_weight = torch._grouped_mm(grad_out.t(), tokens, offs=offsets)
            if _zeroes_empty_groups(grad_weight.device):
                counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
                grad_weight.masked_fill_((counts == 0).view(-1, 1, 1), 0)
        if ctx.untracked:
            if grad_weight is not None:
                grouped_add_(main_grads, grad_weight)
            for weight in weights:
                weight.grad_added_to_main_grad = True
            return (grad_tokens, None, None)
        if main_grads is not None:
            grads = _into_main_grads(weights, main_grads, grad_weight)
        else:
            grads = _into_grads(weights, grad_weight)
        grads = [g if want else None for g, want in zip(grads, wanted, strict=True)]
        return (grad_tokens, None, None, *grads)


def _check_versions(weights, versions: list[int]) -> None:
    """Autograd's check for a saved tensor, for weights that were not saved: the backward
    needs the weights the forward multiplied."""
    for index, (weight, version) in enumerate(zip(weights, versions, strict=True)):
        if weight._version != version:
            raise RuntimeError(
                f"expert {index}'s weight (shape {tuple(weight.shape)}) was modified in place "
                f"between the grouped linear's forward and backward (version {version} -> "
                f"{weight._version}); its input gradient needs the weight the forward used"
            )


def _fused_into_main_grads(grad_out, tokens, offsets, main_grads) -> bool:
    """Whether the weight gradient went into ``main_grad`` by the one-kernel GEMM
    (:mod:`~megatron_hybrid.modules.fast.grouped_wgrad`; False: nothing was written)."""
    if grouped_wgrad_reason(grad_out, tokens, main_grads) is not None:
        return False
    return grouped_wgrad_into_main_grads(grad_out, tokens, offsets, main_grads)


def _into_main_grads(weights, main_grads, grad_weight: torch.Tensor | None) -> list:
    """Add to megatron DDP's ``main_grad`` (None: added already); the gradients autograd
    should deliver."""
    if grad_weight is not None:
        grouped_add_(main_grads, grad_weight)
    grads = []
    for weight in weights:
        if not hasattr(weight, "grad_added_to_main_grad"):
            grads.append(None)  # as megatron's linear: no DDP hook to feed
            continue
        if getattr(weight, "zero_out_wgrad", False):
            grads.append(torch.zeros_like(weight))
        else:
            grads.append(_placeholder(weight))
        weight.grad_added_to_main_grad = True
    return grads


def _engine_accumulates(weights) -> bool:
    """Whether this backward pass accumulates into every weight's ``.grad``: a
    ``backward()`` whose ``inputs`` (if any) hold them, not ``torch.autograd.grad`` (which
    must leave ``.grad`` alone) nor a ``backward(inputs=...)`` without them."""
    try:
        return all(torch._C._will_engine_execute_node(get_gradient_edge(w).node) for w in weights)
    except RuntimeError:  # torch refuses the question for leaves under autograd.grad
        return False


def _into_grads(weights, grad_weight: torch.Tensor) -> list:
    """The gradients autograd should add to the weights' ``.grad`` (see the module doc)."""
    existing = [w.grad for w in weights]
    if all(g is None for g in existing) or _capturing(grad_weight):
        # Under CUDA-graph capture (``schedule/graphs.py``) the backward runs through
        # ``torch.autograd.grad`` and is replayed: no in-place use of ``.grad`` in the graph.
        return list(grad_weight.unbind(0))
    if any(g is None for g in existing) or existing[0].dtype != grad_weight.dtype:
        return list(grad_weight.unbind(0))
    if any(w._backward_hooks for w in weights) or not _engine_accumulates(weights):
        # A hook on a weight must see this micro-batch's gradient, not the running sum; a
        # pass that does not accumulate into .grad must not change it.
        return list(grad_weight.unbind(0))
    view = stacked_view(existing)
    if view is None or view.shape != grad_weight.shape:
        return list(grad_weight.unbind(0))
    view.add_(grad_weight)
    for weight in weights:
        weight.grad = None  # autograd's accumulator adopts the view it gets back
    return list(view.unbind(0))


def grouped_linear(tokens: torch.Tensor, offsets: torch.Tensor, weights) -> torch.Tensor:
    """``[rows, out]``: each expert's rows of ``tokens`` times its weight (transposed).

    Without autograd (``no_grad`` or ``inference_mode``: log-probs, sampling) the grouped GEMM
    runs alone: no autograd function over every expert weight, none of its gradient bookkeeping.
    """
    if not torch.is_grad_enabled():
        return torch._grouped_mm(tokens, stack_weights(weights).transpose(1, 2), offs=offsets)
    if tokens.requires_grad and _idle_hooks(weights):
        # Their gradients go into main_grad in this function's backward, which the tokens'
        # gradient runs; autograd need not know the weights.
        return GroupedLinearFunction.apply(tokens, offsets, tuple(weights))
    return GroupedLinearFunction.apply(tokens, offsets, None, *weights)


def _idle_hooks(weights) -> bool:
    """Whether every weight trains into a ``main_grad`` whose DDP hook is idle
    (:func:`mark_idle_grad_hooks`; DDP gives every parameter that requires a gradient its
    ``main_grad``)."""
    return all(w.requires_grad and getattr(w, _IDLE_HOOK, False) for w in weights)

"""``destinations[e] += source[e]`` for a list of tensors anywhere in memory, in one kernel.

The grouped experts' weight gradient is one ``[E, out, in]`` tensor; its destinations are the
experts' own gradient tensors. Where those lie evenly spaced in one storage (plain autograd: the
stack :mod:`~megatron_hybrid.modules.fast.grouped_linear` hands out) one ``add_`` over a strided
view covers them; so does megatron DDP's ``main_grad`` where ``train`` built the buffers with
the experts in expert order (``training/param_order.py``). megatron's own layout puts them in
reverse parameter order with padding (megatron-core 0.19.2,
``distributed/param_and_grad_buffer.py``), where no view covers them; and the float32 ``main_grad``
with a bfloat16 source takes ``torch._foreach_add_`` off its multi-tensor path (it needs one
dtype), leaving one add kernel, and its launch, per expert. :func:`grouped_add_` then runs one
Triton kernel that finds each destination by its element offset from the first (an ``int64``
table built once per set of destinations and kept on the device), adds in float32 and rounds
once into the destination's dtype. It also takes the float32 stack that one view covers: there
torch's ``add_`` of a bfloat16 source runs its unvectorised mixed-dtype kernel, 490 against
315 microseconds for the issue shape's ``linear_fc1`` (64 x 1,024 x 2,048; one H200,
2026-11-29). Without Triton, on the CPU and during CUDA-graph capture of a new set of
destinations (building the table copies it to the device) one ``add_`` over the view where one
covers them, else the per-expert ``torch._foreach_add_``, runs.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from megatron_hybrid.triton_lazy import lazy_triton

__all__ = ["destination_offsets", "grouped_add_", "stacked_view"]

_OFFSETS: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_MAX_TABLES = 1024  # one per expert linear and model chunk; a bound, not a tuning knob
_BLOCK = 1024


def stacked_view(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """``torch.stack(tensors)`` as a view, where the tensors are contiguous, of one shape and
    dtype, and lie in one storage at equal, increasing distances; else None.

    One elementwise kernel over such a view replaces one kernel per tensor.

    The storage is checked once, on the first tensor: its storage must hold every tensor's
    bytes. Tensors whose addresses lie inside one storage are in it (live storages do not
    overlap), so each tensor need not be asked for its own (``untyped_storage()`` builds a
    Python object per call: 256 experts' weights cost the host about 0.3 ms per linear).
    """
    first = tensors[0]
    if not first.is_contiguous():
        return None
    count, numel = len(tensors), first.numel()
    if count == 1:
        return first.unsqueeze(0)
    size = first.element_size()
    base, shape, dtype = first.data_ptr(), first.shape, first.dtype
    spacing, rem = divmod(tensors[1].data_ptr() - base, size)
    if rem or spacing < numel:
        return None
    step = spacing * size
    for index, tensor in enumerate(tensors):
        if (
            tensor.data_ptr() != base + index * step
            or tensor.shape != shape
            or tensor.dtype != dtype
            or not tensor.is_contiguous()
        ):
            return None
    offset = first.storage_offset()
    if (offset + (count - 1) * spacing + numel) * size > first.untyped_storage().nbytes():
        return None
    return first.as_strided((count, *shape), (spacing, *first.stride()), offset)


@lazy_triton
def _kernel(triton, tl):
    """The Triton kernel, or None where Triton cannot be imported."""

    @triton.jit
    def grouped_add_kernel(dst_ptr, offsets_ptr, src_ptr, numel, BLOCK: tl.constexpr):  # noqa: N803
        group = tl.program_id(1)
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = index < numel
        offset = tl.load(offsets_ptr + group)  # int64: elements from the first destination
        src = tl.load(src_ptr + group.to(tl.int64) * numel + index, mask=mask)
        dst = tl.load(dst_ptr + offset + index, mask=mask)
        out = dst.to(tl.float32) + src.to(tl.float32)
        tl.store(dst_ptr + offset + index, out.to(dst_ptr.dtype.element_ty), mask=mask)

    return grouped_add_kernel, triton.cdiv


def destination_offsets(destinations, capturing: bool) -> torch.Tensor | None:
    """The device table of element offsets of ``destinations`` from the first (``int64``, kept
    per set of addresses), or None where it is not built yet and ``capturing`` (the copy to the
    device would synchronise inside a CUDA-graph capture) or an offset is not whole elements."""
    first = destinations[0]
    size = first.element_size()
    # The element size is part of the key: the same addresses in another dtype are other
    # element offsets.
    key = (first.device, first.dtype, *(d.data_ptr() for d in destinations))
    table = _OFFSETS.get(key)
    if table is not None:
        _OFFSETS.move_to_end(key)
        return table
    if capturing:
        return None  # the copy to the device would synchronise inside the capture
    offsets = []
    for dest in destinations:
        distance, rem = divmod(dest.data_ptr() - first.data_ptr(), size)
        if rem:
            return None
        offsets.append(distance)
    table = torch.tensor(offsets, dtype=torch.int64).to(first.device)
    _OFFSETS[key] = table
    if len(_OFFSETS) > _MAX_TABLES:
        _OFFSETS.popitem(last=False)
    return table


def _triton_add(destinations, source: torch.Tensor) -> bool:
    """The one-kernel add; False where it does not apply (then nothing was written)."""
    found = _kernel()
    if found is None:
        return False
    kernel, cdiv = found
    first = destinations[0]
    numel = first.numel()
    if not source.is_contiguous() or source[0].numel() != numel:
        return False
    for dest in destinations:
        if dest.dtype != first.dtype or dest.device != first.device or not dest.is_contiguous():
            return False
        if dest.numel() != numel:
            return False
    capturing = first.is_cuda and torch.cuda.is_current_stream_capturing()
    table = destination_offsets(destinations, capturing)
    if table is None:
        return False
    kernel[(cdiv(numel, _BLOCK), len(destinations))](first, table, source, numel, BLOCK=_BLOCK)
    return True


def grouped_add_(destinations, source: torch.Tensor, *, use_triton: bool | None = None) -> None:
    """``destinations[e] += source[e]`` for every ``e`` of ``source`` (``[E, ...]``).

    Args:
        destinations: ``E`` tensors of ``source[e]``'s shape (any dtype and place).
        source: the stacked addends.
        use_triton: force (True) or forbid (False) the Triton kernel; default: on CUDA.
    """
    if source.shape[0] != len(destinations):
        raise ValueError(
            f"grouped_add_: {len(destinations)} destinations for {source.shape[0]} addends"
        )
    if use_triton is None:
        use_triton = source.is_cuda and destinations[0].dtype != source.dtype
    if use_triton and _triton_add(destinations, source):
        return
    view = stacked_view(destinations)
    if view is not None and view.shape == source.shape:
        view.add_(source)
        return
    torch._foreach_add_(list(destinations), list(source.unbind(0)))

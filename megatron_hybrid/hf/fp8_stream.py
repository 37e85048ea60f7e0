"""Quantizing a weight stream to block-scaled FP8 in bounded buckets.

``iter_hf_weights(model, quantize="source" | "fp8")`` hands each gathered Hugging Face weight
that is to be FP8 to a :class:`BucketQuantizer`, which holds consecutive ones until a bucket is
full and then quantizes them with one kernel launch per group of weights that share a column
count (the experts of a layer are one or two groups): their rows are stacked, quantized as one
matrix, and split back into each weight's FP8 rows and scale rows. Launching per bucket
instead of per weight is what makes the stream fast for MoE models, whose weights are many and
small (a Qwen3.5-MoE layer has 3 x 64 expert matrices of 2 MB).

A bucket bounds what quantization holds at once: the gathered inputs, their stacked copy and
the FP8 output with its scales. The yielded FP8 tensors are views of their group's output;
they stay valid after the stream moves on (nothing is reused), and the memory goes when the
consumer drops them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_hybrid.hf.config import family_named
from megatron_hybrid.hf.fp8 import (
    FP8_DTYPE,
    RECIPE_BLOCK,
    SCALE_SUFFIX,
    UnsupportedQuantizationError,
    quantize_reference,
    recipe_quantizes,
    scale_shape,
)

__all__ = ["BucketQuantizer", "FP8Spec", "fp8_specs", "quantize"]


def quantize(
    w: torch.Tensor,
    block: tuple[int, int],
    candidate: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~megatron_hybrid.hf.fp8.quantize_reference`'s result; on a CUDA device by the
    fused Triton kernel.

    ``w`` must be 2-D with unit column stride (a row-major matrix or a block of its rows).
    """
    if w.device.type == "cuda":
        # lazy: Triton loads only to quantize CUDA tensors (and after TRITON_INTERPRET is set)
        from megatron_hybrid.hf.fp8_kernel import quantize_blocks

        return quantize_blocks(w, block, candidate, scale_dtype)
    return quantize_reference(w, block, candidate, scale_dtype)


@dataclass(frozen=True)
class FP8Spec:
    """How one Hugging Face weight is quantized.

    Attributes:
        block: ``(bo, bi)``.
        scale_dtype: the scales' dtype in the folder (float32, or bfloat16 where the source
            stored that).
        keep_source_scales: a block whose values are still FP8 multiples of its source scale
            (to bfloat16 precision) keeps that scale (the ``"source"`` mode of a model loaded
            from an FP8 folder: unchanged weights give back their source bytes).
    """

    block: tuple[int, int]
    scale_dtype: torch.dtype = torch.float32
    keep_source_scales: bool = False


@dataclass
class _Pending:
    name: str
    tensor: torch.Tensor
    spec: FP8Spec
    candidate: torch.Tensor | None


class BucketQuantizer:
    """Collects 2-D weights and quantizes them a bucket at a time.

    Args:
        bucket_bytes: most bytes a bucket holds (inputs, their stacked copy, FP8 output and
            scales); a single weight larger than that is a bucket of its own.
    """

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._pending: list[_Pending] = []
        self._bytes = 0

    @staticmethod
    def _cost(tensor: torch.Tensor) -> int:
        # input + its stacked copy + FP8 output (scales are 1 / (bo * bi) of that)
        return tensor.numel() * (2 * tensor.element_size() + 1)

    def add(
        self,
        name: str,
        tensor: torch.Tensor,
        spec: FP8Spec,
        candidate: torch.Tensor | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Queue one weight; returns the tensors of the bucket it closed (possibly none)."""
        if tensor.dim() != 2:
            raise ValueError(f"{name}: only 2-D weights are FP8, got shape {tuple(tensor.shape)}")
        ready = []
        cost = self._cost(tensor)
        if self._pending and self._bytes + cost > self.bucket_bytes:
            ready = self.flush()
        self._pending.append(_Pending(name, tensor, spec, candidate))
        self._bytes += cost
        return ready

    def flush(self) -> list[tuple[str, torch.Tensor]]:
        """Quantize what is queued; ``[(name, q), (name + "_scale_inv", s), ...]`` in the order
        the weights came."""
        pending, self._pending, self._bytes = self._pending, [], 0
        results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for members in _stacks(pending):
            items = [pending[i] for i in members]
            spec = items[0].spec
            tensors = [_row_major(item.tensor) for item in items]
            w = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
            candidate = None
            if spec.keep_source_scales:
                candidate = _cat([item.candidate for item in items])
            q, s = quantize(w, spec.block, candidate, spec.scale_dtype)
            s = s.to(spec.scale_dtype)
            row, scale_row = 0, 0
            for i, tensor in zip(members, tensors, strict=True):
                rows = tensor.shape[0]
                scale_rows = scale_shape(tuple(tensor.shape), spec.block)[0]
                results[i] = (q[row : row + rows], s[scale_row : scale_row + scale_rows])
                row, scale_row = row + rows, scale_row + scale_rows
        out = []
        for i, item in enumerate(pending):
            q, s = results.pop(i)
            out += [(item.name, q), (item.name + SCALE_SUFFIX, s)]
        return out


def _row_major(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.shape[1] <= 1 or tensor.stride(1) == 1 else tensor.contiguous()


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    if any(t is None for t in tensors):
        return None
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _stacks(pending: list[_Pending]) -> list[list[int]]:
    """Indices of weights quantized together: same columns, dtype, device and spec (and
    source scales for all or none); a weight whose rows are not whole blocks ends its stack,
    since a block must not span two weights."""
    open_stacks: dict[tuple, list[int]] = {}
    done: list[list[int]] = []
    for i, item in enumerate(pending):
        t = item.tensor
        key = (
            t.shape[1],
            t.dtype,
            t.device,
            item.spec,
            item.spec.keep_source_scales and item.candidate is not None,
        )
        stack = open_stacks.setdefault(key, [])
        stack.append(i)
        if t.shape[0] % item.spec.block[0]:
            done.append(open_stacks.pop(key))
    return done + [stack for stack in open_stacks.values() if stack]


def fp8_specs(plan, quantize: str, conversion, source_dtypes: dict) -> dict[str, FP8Spec]:
    """Hugging Face name -> how it is quantized, for the names a ``quantize`` mode makes FP8.

    Raises:
        UnsupportedQuantizationError: ``"fp8"`` for a family with no FP8 release recipe, or
            ``"source"`` with FP8 source tensors but no source format.
    """
    if quantize == "none":
        return {}
    if quantize == "source":
        names = [n for n in plan.hf_names() if source_dtypes.get(n) == FP8_DTYPE]
        if names and conversion.quantization is None:
            raise UnsupportedQuantizationError(
                f"{names[0]} was loaded from FP8, but the conversion has no quantization_config "
                "to write it with; pass quantize='fp8' or 'none'"
            )
        return {
            n: FP8Spec(
                conversion.quantization.block,
                source_dtypes.get(n + SCALE_SUFFIX, torch.float32),
                keep_source_scales=True,
            )
            for n in names
        }
    family = family_named(conversion.family)
    if family.fp8_unquantized is None:
        raise UnsupportedQuantizationError(
            f"quantize='fp8': {family.name} has no block-scaled FP8 release whose recipe (which "
            "modules stay unquantized) could be followed; use quantize='none'"
        )
    spec = FP8Spec(RECIPE_BLOCK)
    return {
        name: spec
        for name, shape in plan.hf_shapes.items()
        if recipe_quantizes(name, shape, family.fp8_unquantized)
    }

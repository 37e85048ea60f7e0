"""The grouped experts' weight gradients added into float32 ``main_grad`` by one Triton GEMM.

Without it the grouped backward computes ``grad_out[rows of e]^T @ tokens[rows of e]`` for every
expert with ``torch._grouped_mm``, whose output is bfloat16 only, and then adds that stack into
megatron DDP's float32 ``main_grad`` with a second kernel
(:func:`~megatron_hybrid.modules.fast.grouped_add.grouped_add_`). At ``benchmarks/mfu.py``'s
issue shape (64 experts, hidden 2,048, expert hidden 512, 32,768 routed rows per micro-batch)
those adds were the largest non-matmul item of a profiled ``[*E]`` step: 25.9 ms of float32
adds in 248 kernels (one H200, 2026-11-29), each reading 2 bytes and reading and writing 4 per
weight element, for 805 million expert weights per step and micro-batch.

:func:`grouped_wgrad_into_main_grads` multiplies and adds in one kernel, as apex's
``wgrad_gemm_accum_fp32`` does for a dense linear: a program per expert and ``128 x 64`` tile
of the weight loops over that expert's rows (their end offsets are on the device, so nothing
waits for the host and CUDA graphs may capture it), accumulates in float32 and adds the tile
into the expert's ``main_grad`` (found by its element offset from the first, as the grouped add
finds it). The gradient is not rounded to bfloat16 on the way, as it is not by
TransformerEngine's grouped GEMM with ``gradient_accumulation_fusion``. An expert without rows
adds nothing and leaves its ``main_grad`` untouched.

What it costs (one H200, 2026-11-29, ``linear_fc1`` of the issue shape, 64 x 1,024 x 2,048): with
512 rows per expert (balanced routing) 614 microseconds, 7 % more than the grouped GEMM (260)
and the grouped add (315) it replaces; with half the experts empty 456 against about 590, since
an expert without rows moves none of its ``main_grad``. It is the default for its float32
accumulation, as TransformerEngine's, and for uneven routing; balanced, it costs about 1.7 ms
of a 0.19 s ``[*E]`` step at the issue shape. Through ``train``'s step (``[*E]`` with CUDA
graphs, routing forced balanced) it measured 0.1867 s against 0.1908 s for the two kernels as
they were then (the add torch's unvectorised ``add_``, before the grouped add took such
stacks); against the grouped add's Triton kernel no step was measured.
``MEGATRON_HYBRID_GROUPED_WGRAD=0`` keeps the two kernels, for comparisons.
"""

from __future__ import annotations

import os

import torch

from megatron_hybrid.modules.fast.grouped_add import destination_offsets
from megatron_hybrid.triton_lazy import lazy_triton

__all__ = ["SWITCH", "grouped_wgrad_into_main_grads", "grouped_wgrad_reason"]

#: The environment variable that turns the kernel off (``=0``).
SWITCH = "MEGATRON_HYBRID_GROUPED_WGRAD"

# One configuration, no autotuning (the GPU suite bounds compile time): the best of eight
# tried at the expert shapes on one H200 (2026-11-29; fc1 with 512 rows per expert
# 614 us, against 649 for 128 x 128 tiles with 8 warps and 1,112 with 4).
_BLOCK_M, _BLOCK_N, _BLOCK_K, _WARPS, _STAGES = 128, 64, 64, 4, 3
_DTYPES = (torch.bfloat16, torch.float16)


@lazy_triton
def _kernel(triton, tl):
    """The Triton kernel, or None where Triton cannot be imported."""

    @triton.jit
    def grouped_wgrad_kernel(
        grad_ptr, tokens_ptr, ends_ptr, main_ptr, table_ptr, out_features, in_features,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        expert = tl.program_id(1)
        tiles_n = tl.cdiv(in_features, BLOCK_N)
        tile_m = tl.program_id(0) // tiles_n
        tile_n = tl.program_id(0) % tiles_n
        start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
        end = tl.load(ends_ptr + expert).to(tl.int64)
        if end > start:
            rows_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(start, end, BLOCK_K):
                rows = k + tl.arange(0, BLOCK_K)
                inside = rows < end
                # grad_out^T: [BLOCK_M, BLOCK_K] read from grad_out [rows, out_features].
                a = tl.load(
                    grad_ptr + rows[None, :] * out_features + rows_m[:, None],
                    mask=inside[None, :] & (rows_m[:, None] < out_features), other=0.0,
                )  # fmt: skip
                b = tl.load(
                    tokens_ptr + rows[:, None] * in_features + cols_n[None, :],
                    mask=inside[:, None] & (cols_n[None, :] < in_features), other=0.0,
                )  # fmt: skip
                acc = tl.dot(a, b, acc)
            base = main_ptr + tl.load(table_ptr + expert)
            where = base + rows_m[:, None] * in_features + cols_n[None, :]
            mask = (rows_m[:, None] < out_features) & (cols_n[None, :] < in_features)
            tl.store(where, tl.load(where, mask=mask) + acc, mask=mask)

    return grouped_wgrad_kernel, triton.cdiv


def grouped_wgrad_reason(grad_out: torch.Tensor, tokens: torch.Tensor, main_grads) -> str | None:
    """Why the grouped weight gradient is not added by :func:`grouped_wgrad_into_main_grads`
    (None: it is)."""
    if not grad_out.is_cuda:
        return "not on CUDA"
    if os.environ.get(SWITCH, "1") == "0":
        return f"turned off ({SWITCH}=0)"
    if _kernel() is None:
        return "Triton is not installed"
    if grad_out.dtype not in _DTYPES or tokens.dtype != grad_out.dtype:
        return f"operands of {grad_out.dtype} and {tokens.dtype}"
    first = main_grads[0]
    shape = (grad_out.shape[1], tokens.shape[1])
    if any(g.dtype != torch.float32 or g.shape != shape or not g.is_contiguous()
           or g.device != first.device for g in main_grads):  # fmt: skip
        return f"main_grad not float32 contiguous {shape} on one device"
    return None


def grouped_wgrad_into_main_grads(
    grad_out: torch.Tensor, tokens: torch.Tensor, ends: torch.Tensor, main_grads
) -> bool:
    """``main_grads[e] += grad_out[rows of e]^T @ tokens[rows of e]`` for every expert ``e``.

    Args:
        grad_out: ``[rows, out]``, rows sorted by expert.
        tokens: ``[rows, in]``, the linear's input, the same rows.
        ends: ``[E]`` int32 end offsets of each expert's rows (on the device).
        main_grads: ``E`` float32 ``[out, in]`` destinations, anywhere in memory.

    Returns:
        False where the destinations' offset table would have to be built during CUDA-graph
        capture (then nothing was written: the caller adds another way); else True.
    """
    kernel, cdiv = _kernel()
    capturing = grad_out.is_cuda and torch.cuda.is_current_stream_capturing()
    table = destination_offsets(list(main_grads), capturing)
    if table is None:
        return False
    grad_out, tokens = grad_out.contiguous(), tokens.contiguous()
    out_features, in_features = grad_out.shape[1], tokens.shape[1]
    tiles = cdiv(out_features, _BLOCK_M) * cdiv(in_features, _BLOCK_N)
    kernel[(tiles, len(main_grads))](
        grad_out, tokens, ends, main_grads[0], table, out_features, in_features,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=_WARPS,
        num_stages=_STAGES,
    )  # fmt: skip
    return True

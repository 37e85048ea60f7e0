"""Fused block-scaled FP8 quantization: one Triton program per scale block, one pass over it.

The torch reference (:func:`megatron_hybrid.hf.fp8.quantize_reference`) makes about ten passes
over a weight (float32 copy, padding, abs, amax, division, clamp, cast, and the candidate check
again); this kernel reads each ``bo x bi`` block once, keeps it in registers and writes its FP8
bytes and its scale, computing bit for bit what the reference computes: IEEE division
(``tl.math.div_rn``: Triton's ``/`` is not correctly rounded, and on an H100 with Triton
3.6 ``tl.fdiv(..., ieee_rounding=True)`` was not either), round-to-nearest-even casts, the same
all-zero-block, non-finite and candidate-scale rules. Blocks of any size (powers of two or
not) and partial edge blocks are masked. Under ``TRITON_INTERPRET=1`` (set before Triton is
imported) the same kernel runs on CPU tensors in Triton's interpreter, which is how the unit
tests check it against the reference without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from megatron_hybrid.hf.fp8 import FP8_DTYPE, FP8_MAX, scale_shape

__all__ = ["quantize_blocks"]


@triton.jit
def _round_e4m3(v):
    """``v`` (float32, ``|v| <= 448``) rounded to the nearest ``float8_e4m3fn`` value, ties to
    even, computed in float32: the cast that follows is then exact whatever rounding the
    hardware (or the interpreter) uses for float32 -> FP8. Signs are kept (``-0.0`` too)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = bits & -0x80000000
    magnitude = bits & 0x7FFFFFFF
    # Normal FP8 (|v| >= 2**-6): keep 3 of float32's 23 mantissa bits, ties to even; a carry
    # moves into the exponent as it should.
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -0x100000
    # Subnormal FP8: multiples of 2**-9; adding and subtracting 1.5 * 2**23 rounds x < 8 to an
    # integer, ties to even.
    x = magnitude.to(tl.float32, bitcast=True) * 512.0
    # (* 2**-9 divides by 512 exactly, where Triton's ``/`` would not be IEEE.)
    subnormal = (((x + 12582912.0) - 12582912.0) * 0.001953125).to(tl.int32, bitcast=True)
    rounded = tl.where(magnitude >= 0x3C800000, normal, subnormal)  # 0x3C800000 = 2**-6
    return (rounded | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16(v):
    """``v`` (float32) rounded to bfloat16's precision, ties to even, kept in float32."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_blocks(
    w_ptr,
    q_ptr,
    s_ptr,
    c_ptr,
    rows,
    cols,
    stride_w,
    n_col_blocks,
    FP8_LIMIT: tl.constexpr,
    BO: tl.constexpr,
    BI: tl.constexpr,
    BO_P: tl.constexpr,
    BI_P: tl.constexpr,
    HAS_CANDIDATE: tl.constexpr,
    SCALE_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    rb = pid // n_col_blocks
    cb = pid % n_col_blocks
    i = tl.arange(0, BO_P)
    j = tl.arange(0, BI_P)
    r = rb * BO + i
    c = cb * BI + j
    mask = ((i < BO) & (r < rows))[:, None] & ((j < BI) & (c < cols))[None, :]
    w = tl.load(w_ptr + r[:, None].to(tl.int64) * stride_w + c[None, :], mask=mask, other=0.0)
    x = w.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    # tl.max drops NaN on a GPU (max.f32): counted apart, so that a block holding one gets a
    # NaN scale, as the reference's amax does.
    nans = tl.sum(tl.sum(tl.where(x != x, 1, 0), axis=1), axis=0)
    s = tl.math.div_rn(amax, FP8_LIMIT)
    if SCALE_BF16:
        s = _round_bf16(s)
    s = tl.where(s == 0.0, 1.0, s)
    s = tl.where(nans > 0, float("nan"), s)
    if HAS_CANDIDATE:
        cand = tl.load(c_ptr + pid).to(tl.float32)
        qc = _round_e4m3(tl.clamp(tl.math.div_rn(x, cand), -FP8_LIMIT, FP8_LIMIT))
        misses = tl.where(mask & (_round_bf16(qc * cand) != _round_bf16(x)), 1, 0)
        misses = tl.sum(tl.sum(misses, axis=1), axis=0)
        s = tl.where(misses == 0, cand, s)
    v = tl.math.div_rn(x, s)
    # NaN (a non-finite block's values) is written as 0: the block's scale carries the fault.
    q = _round_e4m3(tl.clamp(tl.where(v == v, v, 0.0), -FP8_LIMIT, FP8_LIMIT))
    q = q.to(tl.float8e4nv)
    tl.store(q_ptr + r[:, None].to(tl.int64) * cols + c[None, :], q, mask=mask)
    tl.store(s_ptr + pid, s)


#: Warps per block program: which is fastest depends on the GPU and the block's registers, and
#: every choice computes the same bytes, so the first launch per block shape times them.
_WARPS = (2, 4, 8, 16)
#: Most values of a block one thread holds. Beyond it the registers spill and ptxas takes far
#: longer: a 128 x 128 block with 2 warps (256 values a thread) took 10 to 30 times as long to
#: compile for sm_90 as with 16 warps (32 a thread): 56 s and 199 s (with source scales) against
#: 5 s and 7 s on a busy CPU; each launch of it also pays for the spills in local memory.
_VALUES_PER_THREAD = 64


def _warps_for(tile: int) -> tuple[int, ...]:
    """The warp counts worth timing for a ``tile``-value block, most warps first (the
    quickest to compile: autotuners told to take their first config take that one)."""
    fitting = [w for w in _WARPS if tile <= _VALUES_PER_THREAD * 32 * w]
    return tuple(sorted(fitting or [max(_WARPS)], reverse=True))


def _prune(configs, named_args, **kwargs):
    """``early_config_prune``: the configs of :func:`_warps_for` this launch's block."""
    args = {**named_args, **kwargs}  # Triton < 3 passed no constexprs: every count, most first
    tile = args["BO_P"] * args["BI_P"] if "BO_P" in args else 0
    warps = _warps_for(tile)
    by_warps = {config.num_warps: config for config in configs}
    return [by_warps[w] for w in warps]


_tuned = triton.autotune(
    [triton.Config({}, num_warps=w) for w in _WARPS],
    key=["BO_P", "BI_P", "HAS_CANDIDATE", "SCALE_BF16"],
    prune_configs_by={"early_config_prune": _prune},
)(_quantize_blocks)


def quantize_blocks(
    w: torch.Tensor,
    block: tuple[int, int],
    candidate: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 of a 2-D weight: :func:`~megatron_hybrid.hf.fp8.quantize_reference`'s
    values from one kernel launch.

    Args:
        w: ``[R, C]`` with unit column stride (a matrix or a run of its rows), any float dtype.
        block: ``(bo, bi)``.
        candidate: ``[ceil(R / bo), ceil(C / bi)]`` source scales to keep where they are exact.
        scale_dtype: the scales' storage dtype (float32 or bfloat16); a new scale is rounded to
            it before ``q`` is computed, so ``q * s`` holds in the stored dtype.

    Returns:
        ``(q float8_e4m3fn [R, C], s float32 [ceil(R / bo), ceil(C / bi)])``.
    """
    if w.dim() != 2 or (w.shape[1] > 1 and w.stride(1) != 1):
        raise ValueError(f"quantize_blocks needs a row-major 2-D weight, got {tuple(w.shape)}")
    rows, cols = w.shape
    bo, bi = block
    nrb, ncb = scale_shape((rows, cols), block)
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=w.device)
    s = torch.empty((nrb, ncb), dtype=torch.float32, device=w.device)
    if q.numel() == 0:
        return q, s.fill_(1.0)
    if candidate is not None:
        if tuple(candidate.shape) != (nrb, ncb):
            raise ValueError(f"candidate scales {tuple(candidate.shape)}, expected {(nrb, ncb)}")
        candidate = candidate.contiguous()
    bo_p, bi_p = triton.next_power_of_2(bo), triton.next_power_of_2(bi)
    tile = bo_p * bi_p
    # Triton's interpreter (the CPU tests) has no timer to tune with: one fixed launch there.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    kernel = _quantize_blocks if interpreted else _tuned
    launch = {"num_warps": _warps_for(tile)[0]} if interpreted else {}
    kernel[(nrb * ncb,)](
        w,
        q,
        s,
        candidate if candidate is not None else s,
        rows,
        cols,
        w.stride(0),
        ncb,
        FP8_LIMIT=FP8_MAX,
        BO=bo,
        BI=bi,
        BO_P=bo_p,
        BI_P=bi_p,
        HAS_CANDIDATE=candidate is not None,
        SCALE_BF16=scale_dtype == torch.bfloat16,
        **launch,
    )
    return q, s

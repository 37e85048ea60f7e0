"""The WY inverse of fla's chunked gated delta rule, exactly and with a rounding-error bound.

Within a chunk of ``C = 64`` tokens, fla's ``chunk_gated_delta_rule`` (0.6.0) builds the strictly
lower-triangular matrix (``i > j``, one per batch row, chunk and head)::

    A[i, j] = beta_i (k_i . k_j) 2 ** (G_i - G_j)      G = the chunk-local cumsum of g / ln 2

and inverts ``I + A``: ``T = (I + A)^-1`` turns keys and values into the WY representation
(``w = T (beta k 2**G)``, ``u = T (beta v)``) that the state recurrence and the output use; the
backward reuses the same ``T``. ``chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel`` does it
in 16 x 16 blocks: each diagonal block by forward substitution (float32, elementwise), the six
blocks below them by 16 block products (its "block merge", see :func:`emulate_fla_solve`). Those
products' operands are what fla rounds to TF32 on NVIDIA GPUs (``SOLVE_TRIL_DOT_PRECISION``, see
:mod:`support.fla_precision`).

:func:`wy_inverse` computes ``T`` exactly (float64 triangular solve) from the inputs the kernel
had; :func:`merge_error_bound` bounds, per element, how far a kernel that follows fla's blocking
may be from it, for a given unit roundoff of the merge's operands, by running error analysis
(first order, Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sections 3.5
and 8.2): a product ``X Y`` of computed operands with errors ``eX``, ``eY`` and operands rounded
with unit roundoff ``u`` is off by at most ``eX |Y| + |X| eY + (2u + u^2 + gamma_16) |X| |Y|``;
a forward-substituted inverse ``X`` of ``L`` by ``|X| eL |X| + gamma_16 |X| |L| |X|``. The
``|X| |Y|`` terms carry the inverse's growth: where the keys of a chunk are nearly dependent
(64 keys in 16 dimensions) and the decays weak, ``|T| |A| |T|`` is far larger than ``|T|``, and a
relative operand error becomes a large error of ``T``. Accumulation is taken in float32 with
unit roundoff ``2^-23`` (covers truncating accumulators as well as rounding ones).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "CHUNK",
    "SolveCheck",
    "check_solve",
    "emulate_fla_solve",
    "from_fla_layout",
    "merge_error_bound",
    "tf32_truncate",
    "wy_inverse",
]

#: fla's chunk (``BT``) and block (``BC``) sizes of the fused kernel.
CHUNK, BLOCK = 64, 16
#: float32 accumulation and elementwise arithmetic (2^-23: rounding or truncating).
U32 = 2.0**-23
#: The blocks below the diagonal, as fla's block merge forms them: ``(row, col)``.
_OFF_DIAGONAL = ((1, 0), (2, 1), (3, 2), (2, 0), (3, 1), (3, 0))


def _gamma(n: int, u: float = U32) -> float:
    return n * u / (1 - n * u)


def tf32_truncate(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` with its low 13 mantissa bits dropped: a TF32 tensor-core operand.

    Triton passes float32 registers to NVIDIA's TF32 instructions unrounded, and the hardware
    reads the top 19 bits (relative error below ``2^-10``; round-to-nearest would give ``2^-11``).
    """
    bits = x.float().contiguous().view(torch.int32)
    return (bits & -8192).view(torch.float32)


def _blocks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, T, H, ...]`` -> ``[B, NT, H, chunk, ...]``, ``T`` zero-padded to whole chunks."""
    batch, steps = x.shape[:2]
    pad = -steps % chunk
    if pad:
        x = torch.cat([x, x.new_zeros(batch, pad, *x.shape[2:])], dim=1)
    x = x.reshape(batch, -1, chunk, *x.shape[2:])
    return x.movedim(3, 2)


def from_fla_layout(a: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """fla's ``[B, T, H, C]`` output (row ``t``, its chunk's columns) -> ``[B, NT, H, C, C]``."""
    return _blocks(a.double(), chunk)


def _kkt(k, g_cum, beta, chunk):
    """``A`` and its magnitude bound ``beta |k_i| . |k_j| 2**dG`` (float64, strictly lower)."""
    k, g, b = (_blocks(t.double(), chunk) for t in (k, g_cum, beta))
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril(-1)
    diff = g[..., :, None] - g[..., None, :]
    # 2**diff only where i > j: above the diagonal diff may be large and positive.
    decay = torch.where(lower, diff, torch.full_like(diff, -math.inf)).exp2()
    scale = b[..., :, None] * decay
    return scale * (k @ k.transpose(-1, -2)), scale * (k.abs() @ k.abs().transpose(-1, -2)), diff


def wy_inverse(k, g_cum, beta, chunk: int = CHUNK) -> torch.Tensor:
    """``T = (I + A)^-1`` per chunk, float64 ``[B, NT, H, C, C]``.

    Args:
        k: keys ``[B, T, H, K]`` as the kernel got them (megatron l2-normalises them).
        g_cum: fla's chunk-local cumulative log2 decays ``[B, T, H]`` (its cumsum kernel's output).
        beta: write strengths ``[B, T, H]``.
    """
    a, _, _ = _kkt(k, g_cum, beta, chunk)
    eye = torch.eye(chunk, dtype=a.dtype, device=a.device)
    return torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False)


def _split(x: torch.Tensor, block: int) -> list[list[torch.Tensor]]:
    n = x.shape[-1] // block
    return [[x[..., i * block:(i + 1) * block, j * block:(j + 1) * block] for j in range(n)]
            for i in range(n)]  # fmt: skip


def merge_error_bound(
    k: torch.Tensor,
    g_cum: torch.Tensor,
    beta: torch.Tensor,
    *,
    operand_roundoff: float,
    kkt_operand_roundoff: float = 0.0,
    store_roundoff: float = 0.0,
    chunk: int = CHUNK,
    block: int = BLOCK,
) -> torch.Tensor:
    """Per element of ``T``: how far fla's fused kernel may be from :func:`wy_inverse` (float64).

    Args:
        k, g_cum, beta: the kernel's inputs (see :func:`wy_inverse`).
        operand_roundoff: unit roundoff of the block merge's operands: 0 for IEEE float32
            dots, ``2^-10`` for TF32 (truncated), about ``2^-18`` for 3xTF32.
        kkt_operand_roundoff: the same for the ``k . k`` dots (0 for bf16 keys, whose products
            are exact, and for float32 keys with ``TRITON_F32_DEFAULT=ieee``; ``2^-10`` for
            float32 keys on Triton's TF32 default).
        store_roundoff: rounding of the stored ``T`` (fla stores it in the keys' dtype:
            ``2^-8`` for bf16, 0 for float32).
    """
    a, a_bar, diff = _kkt(k, g_cum, beta, chunk)
    dim = k.shape[-1]
    # The k . k dot, the decay's exp2 (libdevice, a few ulp) of a rounded difference of cumsums
    # (relative error ln2 * u * |dG|), and the two products with the decay and beta.
    rel = _gamma(dim) + 2 * kkt_operand_roundoff + 6 * U32 + math.log(2) * U32 * diff.abs()
    e_a = _split(torch.where(a_bar > 0, a_bar * rel, torch.zeros_like(a_bar)), block)
    a_blocks = _split(a, block)
    exact = _split(wy_inverse(k, g_cum, beta, chunk), block)
    n = len(a_blocks)
    err = [[torch.zeros_like(a_blocks[0][0]) for _ in range(n)] for _ in range(n)]
    eye = torch.eye(block, dtype=a.dtype, device=a.device)
    for d in range(n):
        t = exact[d][d].abs()
        err[d][d] = t @ e_a[d][d] @ t + _gamma(block) * t @ (eye + a_blocks[d][d].abs()) @ t

    product_rel = 2 * operand_roundoff + operand_roundoff**2 + _gamma(block)

    def product(x, ex, y, ey):
        return ex @ y.abs() + x.abs() @ ey + product_rel * x.abs() @ y.abs()

    # The merge, term by term as fla 0.6.0 forms it (see emulate_fla_solve); exact values from
    # the float64 inverse, errors accumulated.
    for i, j in _OFF_DIAGONAL:
        if i - j == 1:  # -(T_ii A_ij) T_jj
            left = exact[i][i] @ a_blocks[i][j]
            left_err = product(exact[i][i], err[i][i], a_blocks[i][j], e_a[i][j])
            err[i][j] = product(left, left_err, exact[j][j], err[j][j])
            continue
        # -T_ii (sum over m of A_im T_mj)
        terms = [(a_blocks[i][m] @ exact[m][j],
                  product(a_blocks[i][m], e_a[i][m], exact[m][j], err[m][j]))
                 for m in range(j, i)]  # fmt: skip
        inner = sum(v for v, _ in terms)
        inner_err = sum(e for _, e in terms) + _gamma(len(terms) - 1) * sum(
            v.abs() for v, _ in terms
        )
        err[i][j] = product(exact[i][i], err[i][i], inner, inner_err)
    bound = torch.cat([torch.cat(row, dim=-1) for row in err], dim=-2)
    return bound + store_roundoff * wy_inverse(k, g_cum, beta, chunk).abs()


def emulate_fla_solve(
    k: torch.Tensor,
    g_cum: torch.Tensor,
    beta: torch.Tensor,
    *,
    round_operand: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
    drop_block: bool = False,
    chunk: int = CHUNK,
    block: int = BLOCK,
) -> torch.Tensor:
    """fla 0.6.0's fused solve in float32 torch, block by block, ``[B, NT, H, C, C]``.

    ``round_operand`` rounds both operands of every block-merge product (:func:`tf32_truncate`
    for TF32). ``drop_block`` leaves the merge's first block, ``T[16:32, 0:16]``, out (a
    deliberately wrong inverse for negative controls: at any decay it holds ``-A`` next to the
    diagonal). The ``k . k`` dots are IEEE float32, as with ``TRITON_F32_DEFAULT=ieee``.
    """
    kc, g, b = (_blocks(t.float(), chunk) for t in (k, g_cum, beta))
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=kc.device).tril(-1)
    diff = g[..., :, None] - g[..., None, :]
    decay = torch.where(lower, diff, torch.full_like(diff, -math.inf)).exp2()
    a = (kc @ kc.transpose(-1, -2)) * decay * b[..., :, None]
    blocks = _split(a, block)
    n = len(blocks)
    inv = [[None] * n for _ in range(n)]
    for d in range(n):
        # Forward substitution, row by row: row i of (I + A_dd)^-1 - I.
        a_dd = blocks[d][d]
        rows = -a_dd.clone()
        for i in range(2, block):
            row = -a_dd[..., i, :]
            rows[..., i, :] = row + (row[..., :, None] * rows).sum(-2)
        inv[d][d] = rows + torch.eye(block, device=kc.device)

    def dot(x, y):
        return round_operand(x) @ round_operand(y)

    for i, j in _OFF_DIAGONAL:
        if i - j == 1:
            inv[i][j] = -dot(dot(inv[i][i], blocks[i][j]), inv[j][j])
            if drop_block and (i, j) == (1, 0):
                inv[i][j] = torch.zeros_like(inv[i][j])
            continue
        terms = [dot(blocks[i][m], inv[m][j]) for m in range(j, i)]
        inv[i][j] = -dot(inv[i][i], sum(terms))
    zero = torch.zeros_like(blocks[0][0])
    rows = [[inv[i][j] if j <= i else zero for j in range(n)] for i in range(n)]
    return torch.cat([torch.cat(row, dim=-1) for row in rows], dim=-2)


@dataclass(frozen=True)
class SolveCheck:
    """A kernel's ``T`` against the exact one.

    Attributes:
        error_over_bound: the largest ``|T - T_exact| / bound`` (at most 1: within the bound).
        relative_error: ``||T - T_exact|| / ||T_exact||`` (Frobenius, all chunks and heads).
        growth: ``max(|T| |A| |T|) / max(|T|)``: how much the inverse amplifies operand errors.
    """

    error_over_bound: float
    relative_error: float
    growth: float


def check_solve(t_kernel: torch.Tensor, k, g_cum, beta, bound: torch.Tensor) -> SolveCheck:
    """Compare a kernel's ``T`` (``[B, NT, H, C, C]``) with :func:`wy_inverse` and a bound.

    The bound is first order: a factor 2 on it covers the neglected higher-order terms (and
    ``1e-30`` the exactly representable entries), so ``error_over_bound`` is reported against
    ``2 * bound``.
    """
    exact = wy_inverse(k, g_cum, beta)
    error = (t_kernel.double() - exact).abs()
    a, _, _ = _kkt(k, g_cum, beta, CHUNK)
    growth = (exact.abs() @ a.abs() @ exact.abs()).amax() / exact.abs().amax()
    return SolveCheck(
        error_over_bound=float((error / (2 * bound + 1e-30)).amax()),
        relative_error=float(error.norm() / exact.norm()),
        growth=float(growth),
    )

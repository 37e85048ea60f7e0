"""The torch Mamba2 path with its elementwise-heavy pieces compiled.

:class:`~megatron_hybrid.modules.mamba_torch.TorchMambaMixer` (``M`` where mamba_ssm's kernels
are missing) computes the causal conv, the chunked SSD scan and the gated norm with plain torch
operations: masks, exponentials, cumulative sums and float32 casts around a few einsums, each a
kernel of its own and a pass over memory. :class:`FastTorchMambaMixer` runs the same two pure
functions (:func:`~megatron_hybrid.modules.ssd.mamba2_scan` and
:func:`~megatron_hybrid.modules.ssd.gated_rms_norm`) through
:class:`~megatron_hybrid.modules.fast.compiled.CompiledPiece`, so inductor fuses the steps
between the einsums. Packed batches pass their ``seq_idx`` into the same compiled function (a
graph of its own: the boundary masks are tensors, so one graph serves any packing of a row);
context parallelism keeps the eager path (``fast_path_reason`` says which ran). Parameters and
checkpoints are ``TorchMambaMixer``'s.

On CUDA the scan's products run on TF32 (``mamba2_scan(tf32=True)``,
:mod:`megatron_hybrid.kernels.tf32`): at the issue shape of ``benchmarks/mfu.py`` the float32
products were the largest item of the Mamba mixer (about 52 ms of a 0.274 s ``[ME]`` step on
one H200), and mamba_ssm's kernels, what megatron-core runs, multiply bfloat16 operands there.
``MEGATRON_HYBRID_SSD_TF32=0`` keeps them float32 (torch's own TF32 flag does not decide it);
``fast_path_detail`` says which ran (:func:`scan_products`). The reference path, which the fast
one falls back to, stays float32.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from megatron_hybrid.modules.fast.compiled import CompiledPiece
from megatron_hybrid.modules.mamba_torch import GatedRMSNorm, TorchMambaMixer
from megatron_hybrid.modules.ssd import gated_rms_norm, mamba2_scan

__all__ = ["SSD_TF32_SWITCH", "FastGatedRMSNorm", "FastTorchMambaMixer", "scan_products"]

#: The environment variable that keeps the scan's products float32 (``=0``).
SSD_TF32_SWITCH = "MEGATRON_HYBRID_SSD_TF32"


def scan_products(
    device: torch.device, environ: Mapping[str, str] = os.environ
) -> tuple[bool, str]:
    """Whether the fast scan asks for TF32 products on ``device``, and how
    ``fast_path_detail`` names what cuBLAS then computes."""
    if device.type != "cuda":
        return False, "float32 products"
    if environ.get(SSD_TF32_SWITCH, "1") == "0":
        return False, f"float32 products ({SSD_TF32_SWITCH}=0)"
    if environ.get("NVIDIA_TF32_OVERRIDE") == "0":  # cuBLAS's switch, above torch's
        return True, "float32 products (NVIDIA_TF32_OVERRIDE=0)"
    return True, "TF32 products"


_SCAN = CompiledPiece(mamba2_scan, "mamba2_scan")
_NORM = CompiledPiece(gated_rms_norm, "mamba2_gated_rms_norm")


class FastGatedRMSNorm(GatedRMSNorm):
    """``GatedRMSNorm`` through the compiled :func:`~megatron_hybrid.modules.ssd.gated_rms_norm`."""

    def forward(self, y: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """``rmsnorm(y * silu(z)) * weight`` per group of channels."""
        return _NORM(y, z, self.weight, self.group_size, self.eps)


class FastTorchMambaMixer(TorchMambaMixer):
    """``TorchMambaMixer`` whose scan and gated norm run compiled where they can."""

    norm_class = FastGatedRMSNorm
    fast_path_reason: str | None = "not run"
    fast_path_detail: str | None = None

    def _ssm(self, zxbcdt: torch.Tensor, seq_idx: torch.Tensor | None) -> torch.Tensor:
        if self.cp.cp_size > 1:
            self.fast_path_reason = "context parallelism runs the eager scan"
        else:
            self.fast_path_reason = _SCAN.failure
        if self.fast_path_reason is not None:
            return super()._ssm(zxbcdt, seq_idx)
        tf32, self.fast_path_detail = scan_products(zxbcdt.device)
        return _SCAN(
            zxbcdt,
            self.conv1d_weight.squeeze(1),
            self.conv1d_bias,
            self.dt_bias,
            self.A_log,
            self.D,
            seq_idx,
            heads=self.nheads_local_tp,
            groups=self.ngroups_local_tp,
            state=self.d_state,
            head_dim=self.headdim,
            chunk_size=self.chunk_size,
            dt_limit=self.dt_limit,
            d_has_hdim=self.D_has_hdim,
            tf32=tf32,
        )

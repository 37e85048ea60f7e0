"""Naive float32 references for GatedDeltaNet's two kernels, for checking the fast ones.

GatedDeltaNet keeps, per batch row and head, a state matrix ``S`` of shape ``[K, V]`` that maps
keys to values. Starting from ``S = 0``, every time step ``t`` does, in this order::

    S   <- exp(g_t) * S                      # forget: g_t <= 0 is a log decay
    u_t  = beta_t * (v_t - S^T k_t)          # delta rule: move S's prediction for k_t towards v_t
    S   <- S + k_t u_t^T                     # write the correction (a rank-one update)
    o_t  = S^T (scale * q_t)                 # read with the query; scale defaults to K ** -0.5

This is the function that megatron-core's ``torch_chunk_gated_delta_rule`` and fla's
``chunk_gated_delta_rule`` compute blockwise (chunks of 64 steps), in the way megatron's
``GatedDeltaNet`` calls them: q and k already l2-normalised by the layer
(``use_qk_l2norm_in_kernel=False``), the default scale, no initial state and no final state.
:func:`recurrent_gated_delta_rule` runs the recurrence one step at a time with plain torch
operations, so its gradients come from torch's autograd and share no code or blocking with either
kernel. It is slow (``T`` sequential steps) and keeps every step's state for the backward pass:
use it at test sizes only.

:func:`depthwise_causal_conv1d` is the matching reference for the short causal convolution that
the layer runs on q, k and v before the recurrence (fla's ``causal_conv1d`` or ``F.conv1d``).
"""

from __future__ import annotations

import math

import torch
from torch.nn.functional import conv1d, normalize, pad, silu, softplus

__all__ = [
    "depthwise_causal_conv1d",
    "make_gdn_inputs",
    "recurrent_gated_delta_rule",
]

_ACTIVATIONS = {None: lambda x: x, "silu": silu, "swish": silu}


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The gated delta rule, one time step at a time, in float32 (or ``compute_dtype``).

    Args:
        q: Queries ``[B, T, H, K]`` (fla's layout; megatron's layer l2-normalises them first).
        k: Keys ``[B, T, H, K]`` (likewise l2-normalised by the layer).
        v: Values ``[B, T, H, V]``.
        g: Log decays ``[B, T, H]``, ``<= 0`` (the state is multiplied by ``exp(g_t)``).
        beta: Write strengths ``[B, T, H]``, in ``(0, 1)`` after the layer's sigmoid.
        scale: Factor on the queries; ``None`` means ``K ** -0.5`` like both kernels.
        compute_dtype: The dtype of the arithmetic (float64 gives a reference for float32
            paths).

    Returns:
        The outputs ``o`` ``[B, T, H, V]`` in ``q``'s dtype.

    Raises:
        ValueError: If the shapes do not fit together.
    """
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)}, {k.shape}")
    batch, seq, heads, key_dim = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with q's B, T, H, got {tuple(v.shape)}")
    for name, tensor in (("g", g), ("beta", beta)):
        if tensor.shape != q.shape[:3]:
            raise ValueError(f"{name} must be [B, T, H] = {tuple(q.shape[:3])}, got {tensor.shape}")
    if scale is None:
        scale = key_dim**-0.5
    out_dtype = q.dtype
    q, k, v, g, beta = (x.to(compute_dtype) for x in (q, k, v, g, beta))
    q = q * scale
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1])
    outputs = []
    for t in range(seq):
        k_t = k[:, t].unsqueeze(-2)  # [B, H, 1, K]: a row vector, so k_t @ S is S^T k_t
        state = state * g[:, t].exp()[..., None, None]
        correction = beta[:, t, :, None] * (v[:, t] - (k_t @ state).squeeze(-2))
        state = state + k_t.transpose(-1, -2) @ correction.unsqueeze(-2)
        outputs.append((q[:, t].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outputs, dim=1).to(out_dtype)


def depthwise_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """A depthwise causal convolution over time, with ``F.conv1d``, in megatron's layout.

    Output step ``t`` of channel ``d`` is ``sum_j weight[d, j] * x[t - W + 1 + j, d]`` (plus
    ``bias[d]``), with ``x`` zero before the sequence starts; then the activation. The arithmetic
    runs in ``x``'s dtype, so float32 inputs give the reference and bfloat16 inputs reproduce
    megatron's deterministic (``F.conv1d``) path.

    Args:
        x: Input ``[B, T, D]``.
        weight: One filter per channel, ``[D, W]`` (fla's layout; ``nn.Conv1d`` keeps
            ``[D, 1, W]``).
        bias: Optional ``[D]``.
        activation: ``None``, ``"silu"`` or ``"swish"`` (the same function).

    Returns:
        ``[B, T, D]`` in ``x``'s dtype.

    Raises:
        ValueError: If the shapes do not fit or the activation is unknown.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(map(str, _ACTIVATIONS))}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"need x [B, T, D] and weight [D, W], got {x.shape}, {weight.shape}")
    channels, width = weight.shape
    # Left padding only: step t then sees x[t - W + 1 .. t] and nothing later.
    y = conv1d(pad(x.transpose(1, 2), (width - 1, 0)), weight.unsqueeze(1), bias, groups=channels)
    return _ACTIVATIONS[activation](y).transpose(1, 2)


def make_gdn_inputs(
    batch: int,
    seq: int,
    heads: int,
    key_dim: int,
    value_dim: int,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Float32 inputs shaped and distributed like the ones megatron's GatedDeltaNet makes.

    q and k are l2-normalised per head (the layer does it before the kernel); beta is a sigmoid;
    ``g = -A * softplus(alpha + 1)`` as in the layer (``dt_bias`` starts at 1), with the per-head
    ``A`` spread log-uniformly from 0.05 to 16. The layer initialises ``A`` in ``[1, 16]``, where
    the state forgets within a few steps; the weak decays keep long-range terms (across chunk
    boundaries) large enough for an error in them to show.

    Args:
        batch: ``B``.
        seq: ``T``.
        heads: ``H``.
        key_dim: ``K``.
        value_dim: ``V``.
        seed: Seed of a private generator (the global RNG is left alone).
        device: Where the tensors go (they are drawn on the CPU, so every device sees the same).

    Returns:
        Keyword arguments for a kernel: ``q, k, v`` ``[B, T, H, K|V]`` and ``g, beta``
        ``[B, T, H]``, float32, not requiring grad.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    a = torch.logspace(math.log10(0.05), math.log10(16.0), heads)
    inputs = dict(
        q=normalize(randn(batch, seq, heads, key_dim), dim=-1),
        k=normalize(randn(batch, seq, heads, key_dim), dim=-1),
        v=randn(batch, seq, heads, value_dim),
        g=-a * softplus(randn(batch, seq, heads) + 1.0),
        beta=torch.sigmoid(randn(batch, seq, heads)),
    )
    return {name: t.to(device) for name, t in inputs.items()}

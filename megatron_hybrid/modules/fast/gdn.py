"""GatedDeltaNet's chunked delta rule in torch with a parallel scan over chunks.

megatron-core 0.19.2's torch path (``torch_chunk_gated_delta_rule``, what its GatedDeltaNet
runs in ``deterministic_mode``: on the CPU, and on GPUs where fla's kernels cannot run; fla 0.6.0
refuses its backward on Hopper with the Triton that torch 2.11 ships) inverts each chunk's
``64 x 64`` triangular system row by row (63 steps of small kernels) and then walks the chunks
one after another (a handful of kernels per chunk, 64 chunks at sequence 4096): about 3,300
kernels per layer for forward and backward, which leaves a GPU idle more than 90 % of the time.

:func:`scan_chunk_gated_delta_rule` computes the same function (float32 throughout, as
megatron's) with a fixed number of batched operations, whatever the sequence length:

* each chunk's triangular system is one batched ``torch.linalg.solve_triangular`` with the
  values and the decayed keys as right-hand sides (``U = T V_beta``, ``W = T (K_beta e^g)``,
  ``T = (I + tril(K_beta K^T * decay, -1))^-1``);
* the state before each chunk comes from a log-depth (Hillis-Steele) scan over the chunks' affine
  maps ``S -> M_i S + B_i`` with ``M_i = e^{g_last} I - Kd_i^T W_i`` and ``B_i = Kd_i^T U_i``
  (``Kd_i`` the keys decayed to the chunk's end): ``ceil(log2(chunks))`` batched matmuls;
* every chunk's output, ``(Q e^g) S_i + (Q K^T * decay) (U_i - W_i S_i)``, in one batch.

Each ``M_i`` is the chunk's product of per-step transitions ``e^{g_t}(I - beta_t k_t k_t^T)``,
whose norm is at most 1 for l2-normalised keys and ``beta`` in (0, 1), so the products the scan
forms stay bounded. The scan does ``dk^3`` work per chunk and level where megatron's loop does
``C dk dv`` per chunk: more arithmetic, far fewer launches.

:class:`FastGatedDeltaNet` is megatron's ``GatedDeltaNet`` whose torch path is this function;
where fla's Triton kernels run (:func:`~megatron_hybrid.modules.fast.selection.gdn_rule_choice`)
it keeps them. Parameters and checkpoints are megatron's.
"""

from __future__ import annotations

import torch

from megatron_hybrid.modules.fast.selection import gdn_rule_choice
from megatron_hybrid.modules.gated_delta_net import HybridGatedDeltaNet

__all__ = ["FastGatedDeltaNet", "scan_chunk_gated_delta_rule"]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _scan_states(
    transition: torch.Tensor, offset: torch.Tensor, initial: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering each chunk, and the state after the last, of ``S <- M_i S + B_i``.

    Args:
        transition: ``M`` ``[..., n, dk, dk]``.
        offset: ``B`` ``[..., n, dk, dv]``.
        initial: ``S_0`` ``[..., dk, dv]`` or None (zero).
    """
    chunks = transition.shape[-3]
    step = 1
    while step < chunks:
        # Element i absorbs element i - step: apply the earlier map first, then this one.
        later_m, later_b = transition[..., step:, :, :], offset[..., step:, :, :]
        offset = torch.cat(
            [offset[..., :step, :, :], later_m @ offset[..., :-step, :, :] + later_b], dim=-3
        )
        if 2 * step < chunks or initial is not None:
            transition = torch.cat(
                [transition[..., :step, :, :], later_m @ transition[..., :-step, :, :]], dim=-3
            )
        step *= 2
    after = offset if initial is None else offset + transition @ initial.unsqueeze(-3)
    first = torch.zeros_like(after[..., :1, :, :]) if initial is None else initial.unsqueeze(-3)
    return torch.cat([first, after[..., :-1, :, :]], dim=-3), after[..., -1, :, :]


def scan_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule in chunks, with megatron-core's ``torch_chunk_gated_delta_rule``
    signature and results (see the module docstring for the method).

    Args:
        q: ``[B, T, H, dk]``.
        k: ``[B, T, H, dk]``.
        v: ``[B, T, H, dv]``.
        g: log decays ``[B, T, H]`` (``<= 0``).
        beta: write strengths ``[B, T, H]``.
        chunk_size: steps per chunk.
        initial_state: ``[B, H, dk, dv]`` or None.
        output_final_state: also return the state after the last step.
        use_qk_l2norm_in_kernel: l2-normalise q and k first.
        cu_seqlens: must be None (packed sequences run on fla's kernels).

    Returns:
        ``(o [B, T, H, dv] in q's dtype, final state [B, H, dk, dv] float32 or None)``.
    """
    if cu_seqlens is not None:
        raise ValueError(
            "packed (THD) GatedDeltaNet input needs fla's kernels (cu_seqlens); the torch scan "
            "takes padded batches only"
        )
    dtype = q.dtype
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q, k, v, beta, g = (x.transpose(1, 2).float() for x in (q, k, v, beta, g))
    batch, heads, seq, key_dim = k.shape
    value_dim = v.shape[-1]
    pad = (-seq) % chunk_size
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = (torch.nn.functional.pad(x, (0, pad)) for x in (beta, g))
    chunks = (seq + pad) // chunk_size
    q = q * key_dim**-0.5
    q, k, v = (x.reshape(batch, heads, chunks, chunk_size, -1) for x in (q, k, v))
    beta, g = (x.reshape(batch, heads, chunks, chunk_size) for x in (beta, g))

    g = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[l, s] = exp(g_l - g_s) for s <= l; the masked entries never reach exp.
    diff = g.unsqueeze(-1) - g.unsqueeze(-2)
    decay = torch.where(causal, diff, torch.full_like(diff, -torch.inf)).exp()
    k_beta = k * beta.unsqueeze(-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    system = eye + ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * g.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([value_dim, key_dim], dim=-1)

    g_last = g[..., -1]
    k_decayed = (k * (g_last.unsqueeze(-1) - g).exp().unsqueeze(-1)).transpose(-1, -2)
    eye_k = torch.eye(key_dim, dtype=q.dtype, device=q.device)
    transition = g_last.exp()[..., None, None] * eye_k - k_decayed @ w
    offset = k_decayed @ u
    initial = None if initial_state is None else initial_state.float()
    states, final = _scan_states(transition, offset, initial)

    attn = (q @ k.transpose(-1, -2)) * decay
    out = (q * g.exp().unsqueeze(-1)) @ states + attn @ (u - w @ states)
    out = out.reshape(batch, heads, chunks * chunk_size, value_dim)[:, :, :seq]
    out = out.transpose(1, 2).contiguous().to(dtype)
    return out, (final if output_final_state else None)


class FastGatedDeltaNet(HybridGatedDeltaNet):
    """The package's ``GatedDeltaNet`` (float32 decay) with :func:`scan_chunk_gated_delta_rule`
    as its torch path (``deterministic_mode``; otherwise fla's kernels, as in megatron).
    ``gdn_kernel`` names the rule and ``gdn_kernel_reason`` says why; ``fast_path_reason`` is
    None (both choices are the fast path)."""

    fast_path_reason: str | None = None

    def _setup_variant_attrs(self):
        super()._setup_variant_attrs()
        self.gdn_kernel, self.gdn_kernel_reason = gdn_rule_choice(self.config)
        if self.gdn_kernel == "scan":
            self.gated_delta_rule = scan_chunk_gated_delta_rule

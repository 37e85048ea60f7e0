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


_CONSTANTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(chunk_size: int, key_dim: int, dtype: torch.dtype, device: torch.device):
    """The mask above the diagonal of a chunk and the ``dk x dk`` identity, made once per
    device (not inside a CUDA-graph capture, whose memory pool they would outlive)."""
    key = (chunk_size, key_dim, dtype, device)
    found = _CONSTANTS.get(key)
    if found is None:
        above = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).triu(1)
        found = (above, torch.eye(key_dim, dtype=dtype, device=device))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _CONSTANTS[key] = found
    return found


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[chunks, groups, r, c]`` (contiguous chunk-major) as a batch of ``r x c`` matrices."""
    return x.view(-1, x.shape[-2], x.shape[-1])


class _Absorb(torch.autograd.Function):
    """One scan level of the offsets: ``B'_i = B_i + M_i B_{i-s}`` for ``i >= s``, ``B_i`` before.

    Written out (rather than as slices, a product and a concatenation) because autograd would
    give each of the level's slices a zero-filled full-size gradient: here the backward is two
    batched products and an in-place add on contiguous chunk-major blocks.
    """

    @staticmethod
    def forward(ctx, m: torch.Tensor, b: torch.Tensor, step: int):
        ctx.save_for_backward(m, b)
        ctx.step = step
        out = torch.empty_like(b)
        out[:step].copy_(b[:step])
        torch.baddbmm(_flat(b[step:]), _flat(m[step:]), _flat(b[:-step]), out=_flat(out[step:]))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        m, b = ctx.saved_tensors
        step = ctx.step
        grad = grad.contiguous()
        grad_m = torch.empty_like(m)
        grad_m[:step].zero_()
        torch.bmm(_flat(grad[step:]), _flat(b[:-step]).transpose(1, 2), out=_flat(grad_m[step:]))
        grad_b = grad.clone()
        grad_b[:-step].add_(
            torch.bmm(_flat(m[step:]).transpose(1, 2), _flat(grad[step:])).view_as(grad[step:])
        )
        return grad_m, grad_b, None


class _Compose(torch.autograd.Function):
    """One scan level of the maps: ``M'_i = M_i M_{i-s}`` for ``i >= s``, ``M_i`` before."""

    @staticmethod
    def forward(ctx, m: torch.Tensor, step: int):
        ctx.save_for_backward(m)
        ctx.step = step
        out = torch.empty_like(m)
        out[:step].copy_(m[:step])
        torch.bmm(_flat(m[step:]), _flat(m[:-step]), out=_flat(out[step:]))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (m,) = ctx.saved_tensors
        step = ctx.step
        grad = grad.contiguous()
        grad_m = torch.empty_like(m)
        grad_m[:step].copy_(grad[:step])
        torch.bmm(_flat(grad[step:]), _flat(m[:-step]).transpose(1, 2), out=_flat(grad_m[step:]))
        grad_m[:-step].add_(
            torch.bmm(_flat(m[step:]).transpose(1, 2), _flat(grad[step:])).view_as(grad[step:])
        )
        return grad_m, None


def _scan_states(
    transition: torch.Tensor, offset: torch.Tensor, initial: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering each chunk, and the state after the last, of ``S <- M_i S + B_i``.

    The scan runs chunk-major (``[chunks, batch, ...]``): every level's shifted operands are
    then contiguous blocks that its batched products read in place, and each level is one
    autograd node (:class:`_Absorb`, :class:`_Compose`) with a backward of its own.

    Args:
        transition: ``M`` ``[..., n, dk, dk]``.
        offset: ``B`` ``[..., n, dk, dv]``.
        initial: ``S_0`` ``[..., dk, dv]`` or None (zero).

    Returns:
        ``(states [..., n, dk, dv] contiguous, final [..., dk, dv])``.
    """
    batch_shape, chunks = transition.shape[:-3], transition.shape[-3]
    key_dim, value_dim = offset.shape[-2], offset.shape[-1]
    m = transition.movedim(-3, 0).reshape(chunks, -1, key_dim, key_dim).contiguous()
    b = offset.movedim(-3, 0).reshape(chunks, -1, key_dim, value_dim).contiguous()
    groups = m.shape[1]
    step = 1
    while step < chunks:
        # Element i absorbs element i - step: apply the earlier map first, then this one.
        b = _Absorb.apply(m, b, step)
        if 2 * step < chunks or initial is not None:
            m = _Compose.apply(m, step)
        step *= 2
    if initial is None:
        after = b
        first = torch.zeros_like(b[:1])
    else:
        first = initial.reshape(1, groups, key_dim, value_dim)
        after = b + torch.matmul(m, first)
    states = torch.cat([first, after[:-1]]).view(chunks, *batch_shape, key_dim, value_dim)
    final = after[-1].view(*batch_shape, key_dim, value_dim)
    return states.movedim(0, -3).contiguous(), final


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
    above, eye_k = _constants(chunk_size, key_dim, q.dtype, q.device)
    # decay[l, s] = exp(g_l - g_s) for s <= l; the masked entries never reach exp.
    diff = g.unsqueeze(-1) - g.unsqueeze(-2)
    decay = diff.masked_fill(above, -torch.inf).exp()
    k_beta = k * beta.unsqueeze(-1)
    # I + tril(., -1): the unit diagonal is implied by unitriangular=True.
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * g.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([value_dim, key_dim], dim=-1)

    g_last = g[..., -1]
    k_decayed = (k * (g_last.unsqueeze(-1) - g).exp().unsqueeze(-1)).transpose(-1, -2)
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

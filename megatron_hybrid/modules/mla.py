"""MLA self-attention of the ``local`` backend with the RoPE key's gradient complete under TP.

With a column-parallel ``linear_kv_down_proj`` (the local spec's ``ColumnParallelLinear``),
megatron-core 0.19.2's ``MLASelfAttention.get_query_key_value_tensors``
(``transformer/multi_latent_attention.py``) all-gathers ``kv_combined = [kv_compressed;
k_pos_emb]`` over tensor parallelism and splits its gradient back without a reduction. That is
right for ``kv_compressed``, whose gradient every rank already holds whole (the up-projection's
input region all-reduces it), and wrong for ``k_pos_emb``, the RoPE key shared by all heads:
each rank's gradient there comes from its own heads only, so the down-projection's RoPE rows
(and everything before them) trained on a fraction of their gradient at TP > 1.

:class:`HybridMLASelfAttention` does the gather itself in ``_qkv_down_projection`` and returns
the full-width ``kv_combined``, which megatron-core then treats as the output of a replicated
down-projection: without sequence parallelism through :class:`_GatherSummingRope`, whose
backward sums the RoPE columns over TP before taking this rank's slice; with it, gathered and
scattered along the sequence, so that megatron-core's own sequence gather of ``k_pos_emb``
(whose backward is a reduce-scatter) sums them. The forward pass is unchanged, bit for bit.

With sequence parallelism megatron-core then takes ``kv_compressed`` as a slice of the last
dimension of that full-width tensor (``torch.split``), a view that is not contiguous, where its
own path scatters a contiguous copy. ``linear_kv_up_proj`` all-gathers its input over the
sequence, and NCCL refuses a non-contiguous one ("Tensors must be contiguous"; gloo on a CPU
accepts it). A ``kv_layernorm`` makes a new tensor; without one (``qk_layernorm`` off, an
``IdentityOp``) :class:`_Contiguous` stands in its place: no parameters, no checkpoint keys.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

__all__ = ["HybridMLASelfAttention"]


class _GatherSummingRope(torch.autograd.Function):
    """Forward: all-gather along the last dim over ``group``. Backward: sum the last ``rope``
    columns of the gradient over ``group`` (their partial sums come from each rank's heads),
    then keep this rank's slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, rope: int) -> torch.Tensor:
        ctx.group, ctx.rope = group, rope
        parts = [torch.empty_like(local) for _ in range(group.size())]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, rope = ctx.group, ctx.rope
        grad = grad.contiguous().clone()
        summed = grad[..., -rope:].contiguous()
        torch.distributed.all_reduce(summed, group=group)
        grad[..., -rope:] = summed
        width = grad.shape[-1] // group.size()
        start = group.rank() * width
        return grad[..., start : start + width].contiguous(), None, None


class _Contiguous(torch.nn.Module):
    """The identity as a contiguous tensor (``kv_layernorm``'s place under sequence parallelism
    when MLA has no KV norm; see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous()


class HybridMLASelfAttention(MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` whose RoPE key gets its whole gradient under TP (see
    the module docstring); parameters, checkpoint keys and the forward pass are megatron-core's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.sequence_parallel and isinstance(self.kv_layernorm, IdentityOp):
            self.kv_layernorm = _Contiguous()

    def _qkv_down_projection(self, hidden_states):
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        width = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) == width:  # a replicated down-projection: already right
            return q_compressed, kv_combined
        group = self.tp_group
        if self.config.sequence_parallel:
            whole = gather_from_tensor_model_parallel_region(kv_combined, group=group)
            return q_compressed, scatter_to_sequence_parallel_region(whole, group=group)
        rope = self.config.qk_pos_emb_head_dim
        return q_compressed, _GatherSummingRope.apply(kv_combined, group, rope)

"""MLA self-attention with the fast path's rotary embedding (``+``).

megatron-core 0.19.2's ``MLASelfAttention.get_query_key_value_tensors``
(``transformer/multi_latent_attention.py``) rotates the RoPE parts of the query and key through
its module's ``apply_rotary_pos_emb`` with MLA's interleaving (``mla_rotary_interleaved``: the
even channels, then the odd ones, before the usual rotation). On packed (THD) rows that is
``_apply_rotary_pos_emb_thd``: the sequence lengths and the total read on the host
(``.tolist()``, ``.item()``: a wait for the GPU in every MLA layer of every micro-batch) and one
sequence at a time, about 70 operators per sequence and tensor; measured on one H200 (the
issue shape of ``benchmarks/mfu.py``, packed rows of several documents), its forward was 85 ms of
host time per step, four times the other attention's.

:class:`FastMLASelfAttention` runs megatron's method with that function standing in for its
module's name during the call (the method reads the name when it runs): the interleaving as
megatron does it, then :func:`~megatron_hybrid.modules.fast.rope.apply_rope` or, on packed rows,
:func:`~megatron_hybrid.modules.fast.rope.apply_rope_thd` (positions found on the device, the
whole row at once). Where :func:`~megatron_hybrid.modules.fast.selection.mla_rope_reason` says
so, megatron's own RoPE runs (``fast_path_reason``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from megatron.core.transformer import multi_latent_attention

from megatron_hybrid.modules.fast.rope import apply_rope, apply_rope_thd
from megatron_hybrid.modules.fast.selection import mla_rope_reason
from megatron_hybrid.modules.mla import HybridMLASelfAttention
from megatron_hybrid.padding.fixed import rope_restart

__all__ = ["FastMLASelfAttention", "mla_rope"]

_MEGATRON_ROPE = multi_latent_attention.apply_rotary_pos_emb


def mla_rope(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group=None,
    mla_rotary_interleaved: bool = False,
    restart: bool | None = None,
) -> torch.Tensor:
    """megatron-core 0.19.2's ``apply_rotary_pos_emb`` as MLA calls it (unfused,
    non-interleaved rotation, no context parallelism: :func:`mla_rope_reason` holds these),
    computed by the fast path's RoPE; a tensor wider than the rotation goes to megatron's."""
    if mla_rotary_interleaved and t.shape[-1] != freqs.shape[-1]:
        return _MEGATRON_ROPE(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                              cp_group=cp_group, mla_rotary_interleaved=True)  # fmt: skip
    if mla_rotary_interleaved:
        t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    if cu_seqlens is None:
        return apply_rope(t, freqs, mscale)
    return apply_rope_thd(t, freqs, cu_seqlens, mscale, restart)


@contextlib.contextmanager
def _rope_in_megatrons_mla(restart: bool | None):
    """``mla_rope`` in place of megatron's function for the duration of one call; ``restart``
    as :func:`~megatron_hybrid.modules.fast.rope.apply_rope_thd` takes it."""
    multi_latent_attention.apply_rotary_pos_emb = functools.partial(mla_rope, restart=restart)
    try:
        yield
    finally:
        multi_latent_attention.apply_rotary_pos_emb = _MEGATRON_ROPE


class FastMLASelfAttention(HybridMLASelfAttention):
    """:class:`~megatron_hybrid.modules.mla.HybridMLASelfAttention` whose query and key are
    rotated by the fast path's RoPE (see the module docstring); parameters, checkpoint keys and
    the rest of the forward pass are the reference's."""

    fast_path_reason: str | None = "not run"
    #: Its RoPE reads packed boundaries on the device (``GraphPiece.packed``); megatron sizes
    #: MLA's rotary table by ``max_seqlen_q``, which fixed-size boundaries hold fixed.
    reads_fixed_packed_on_device = True

    def get_query_key_value_tensors(
        self,
        hidden_states,
        key_value_states=None,
        position_ids=None,
        packed_seq_params=None,
        inference_context=None,
        *,
        inference_params=None,
    ):
        """megatron's query, key and value (and latents), rotated by :func:`mla_rope` where
        :func:`mla_rope_reason` allows it."""
        reason = mla_rope_reason(self, packed_seq_params, inference_context or inference_params)
        self.fast_path_reason = reason
        # megatron's MLA cuts the table (sized by the row for fixed-size boundaries) to the
        # row's length: rope_restart says so explicitly.
        restart = rope_restart(packed_seq_params)
        context = _rope_in_megatrons_mla(restart) if reason is None else contextlib.nullcontext()
        with context:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, packed_seq_params,
                inference_context, inference_params=inference_params,
            )  # fmt: skip

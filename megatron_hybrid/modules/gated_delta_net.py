"""GatedDeltaNet (``G``) with its log decay computed in float32 from the gate parameters.

megatron-core 0.19.2's ``GatedDeltaNet._compute_g_and_beta`` (``ssm/gated_delta_net/gdn.py``)
computes ``g = -A_log.exp() * softplus(alpha.float() + dt_bias)``: ``exp`` runs in the
parameter's dtype, so in a bf16 model ``exp(A_log)`` is rounded to bf16 (8 bits) before it
scales every token's decay of that head, a systematic relative error of up to ``2^-9`` in ``g``
that ``exp(sum g)`` then carries through the recurrence, and its backward rounds through bf16
twice more. transformers (``-self.A_log.float().exp() * softplus(a.float() + self.dt_bias)`` in
its Qwen3.5 / Qwen3-Next modeling code) and fla's own fused gate (``use_gate_in_kernel``) take
``exp`` in float32. :class:`HybridGatedDeltaNet` does the same; nothing else differs, so
checkpoints, THD handling and the kernels are megatron-core's, except where the host would
wait for the GPU or fla's backward cannot run:

* megatron's checks of a packed batch's boundaries read them on the host once per micro-batch,
  not three times per layer (:meth:`HybridGatedDeltaNet._resolve_cu_seqlens`);
* fla's kernels get their chunk indices (which chunk of which sequence each program computes)
  built from those host values and copied without a wait (:func:`fla_chunk_indices`): given only
  ``cu_seqlens`` on the GPU, fla 0.6.0 builds them on the device with a ``repeat_interleave``
  whose output size the host must read (``fla/ops/utils/index.py``, ``_segmented_arange``),
  once for the conv and once for the rule of every micro-batch;
* fla's rule gets the query/key heads as they are: it shares each among ``HV // H`` value heads
  itself (fla 0.6.0's grouped value attention), so megatron's ``repeat_interleave`` of queries
  and keys to one per value head (``_prepare_input_for_gated_delta_rule``) is a copy of
  ``HV / H`` times their size per layer that the rule does not need
  (:meth:`HybridGatedDeltaNet._prepare_input_for_gated_delta_rule`);
* packed rows under CUDA graphs: given fixed-size boundaries
  (:class:`~megatron_hybrid.padding.fixed.FixedPackedSeqParams`, what a graphed piece gets), the
  layer reads nothing on the host and fla's kernels get a chunk table of a fixed size built on
  the device (:func:`fixed_chunk_indices`), so one graph replays every packed row of one length
  and capacity (:meth:`HybridGatedDeltaNet.forward`);
* where fla's kernels run (on GPUs without ``deterministic_mode``) the package's gated
  ``chunk_bwd_dqkwg`` is registered with fla: fla refuses its own on Hopper with Triton
  3.4-3.7.0 (:mod:`~megatron_hybrid.modules.fla_backend` says what runs where and why).
"""

from __future__ import annotations

import functools
from itertools import pairwise
from typing import Any

import torch
from megatron.core.jit import jit_fuser
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.gated_delta_net import common as megatron_gdn_common
from megatron.core.ssm.gated_delta_net import gdn as megatron_gdn
from torch.nn.functional import softplus

from megatron_hybrid.modules.fla_backend import register_fla_backend
from megatron_hybrid.padding.batch import derived, host_values, to_device
from megatron_hybrid.padding.fixed import FixedPackedSeqParams, row_segments

__all__ = [
    "FLA_CHUNK_SIZE",
    "HybridGatedDeltaNet",
    "fixed_chunk_indices",
    "fixed_fla_boundaries",
    "fla_chunk_indices",
]

#: The chunk size of fla 0.6.0's ``chunk_gated_delta_rule`` and ``causal_conv1d`` (both default
#: to 64 and megatron-core passes none).
FLA_CHUNK_SIZE = 64


def fla_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int = FLA_CHUNK_SIZE) -> torch.Tensor:
    """fla's ``prepare_chunk_indices(cu_seqlens, chunk_size)`` without the host waiting.

    Row ``r`` is ``(sequence, chunk within it)`` of the ``r``-th chunk of ``chunk_size`` tokens,
    sequences in order, a sequence of ``n`` tokens owning ``ceil(n / chunk_size)`` chunks (none if
    empty); dtype and device are ``cu_seqlens``'. Made from the boundaries' host values, copied
    from pinned memory and kept for as long as ``cu_seqlens`` lives, so every layer of a
    micro-batch shares one copy.
    """

    def make() -> torch.Tensor:
        offsets = host_values(cu_seqlens)
        rows = [
            (sequence, chunk)
            for sequence, (start, end) in enumerate(pairwise(offsets))
            for chunk in range(-(-(end - start) // chunk_size))
        ]
        host = torch.tensor(rows, dtype=cu_seqlens.dtype).reshape(-1, 2)
        return to_device(host, cu_seqlens.device)

    return derived(cu_seqlens, ("fla_chunk_indices", chunk_size), make)


def fixed_chunk_indices(
    cu_seqlens: torch.Tensor, rows: int, chunk_size: int = FLA_CHUNK_SIZE
) -> torch.Tensor:
    """fla's chunk indices for boundaries of a fixed size, built on the device in a fixed size.

    :func:`fla_chunk_indices` has one row per chunk, a number that follows the lengths; a CUDA
    graph replays the grid it was captured with. This table has ``rows // chunk_size +
    segments`` rows (``segments = cu_seqlens.numel() - 1``), a bound on the chunks of any
    ``rows`` tokens in that many segments (each adds at most one partial chunk): first the real
    chunks, as :func:`fla_chunk_indices` gives them, then spare rows that name chunk 0 of the
    last segment. That segment must be empty (:func:`fixed_fla_boundaries` appends one): fla
    0.6.0's chunk kernels take a chunk's length from the boundaries and mask every store by it,
    so a spare row's program stores nothing (its per-chunk partial sums, the conv's weight
    gradient, are zeros); what it reads (state rows nothing wrote for it, a scalar of the row
    before) is discarded. On a segment that holds rows, a spare row would compute that
    segment's first chunk again from those unwritten state rows, and store it.

    Args:
        cu_seqlens: ``[segments + 1]`` boundaries, from 0 to ``rows``, the last segment empty.
        rows: the row's length (tokens).
        chunk_size: tokens per chunk.

    Returns:
        ``[rows // chunk_size + segments, 2]`` ``(segment, chunk within it)`` rows in
        ``cu_seqlens``' dtype and device; no host read.
    """
    segments = cu_seqlens.numel() - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    counts = (lengths + (chunk_size - 1)).div(chunk_size, rounding_mode="floor")
    starts = torch.nn.functional.pad(counts.cumsum(0), (1, 0))  # first table row per segment
    slots = torch.arange(
        rows // chunk_size + segments, device=cu_seqlens.device, dtype=starts.dtype
    )
    # The segment whose chunks hold the slot (empty segments own none); spare slots fall past
    # the last start and go to the last segment.
    segment = row_segments(starts, slots).clamp_(max=segments - 1)
    real = slots < starts[-1]
    chunk = torch.where(real, slots - starts[segment], 0)
    return torch.stack([segment, chunk], 1).to(cu_seqlens.dtype)


def fixed_fla_boundaries(
    params: FixedPackedSeqParams, chunk_size: int = FLA_CHUNK_SIZE
) -> torch.Tensor:
    """The boundaries fla's kernels get for fixed-size packed parameters, with their chunk table.

    megatron's GatedDeltaNet takes the physical boundaries (``cu_seqlens_q_padded``): pad rows
    between sequences run with the sequence before them, as in eager calls. One empty segment is
    appended, where the spare rows of :func:`fixed_chunk_indices` point (the capacity may leave
    none: rows after the last sequence fill the segment after it). The table is kept for
    :func:`fla_chunk_indices` to find. Both are made anew on every call, from the tensors given:
    inside a CUDA-graph capture they are recorded and recomputed on each replay, where a table
    kept from the capture's warm-up would hold the warm-up's boundaries.

    Args:
        params: fixed-size parameters (``padding.fixed.fixed_capacity_params``).
        chunk_size: tokens per chunk of fla's kernels.

    Returns:
        ``[capacity + 2]`` boundaries in ``params``' dtype and device; no host read.
    """
    padded = params.cu_seqlens_q_padded
    boundaries = torch.cat([padded, padded[-1:]])
    table = fixed_chunk_indices(boundaries, params.total_tokens, chunk_size)
    derived(boundaries, ("fla_chunk_indices", chunk_size), lambda: table)
    return boundaries


def _with_chunk_indices(kernel):
    """``kernel`` (fla's conv or rule) given :func:`fla_chunk_indices` with GPU ``cu_seqlens``.

    Only where the indices are the ones fla would make: chunks of :data:`FLA_CHUNK_SIZE` over
    the ``cu_seqlens`` passed. With a ``cp_context`` fla takes the boundaries from it instead,
    and another ``chunk_size`` needs other indices (megatron-core 0.19.2 passes neither: its
    context parallelism hands each rank whole sequences by all-to-all); a caller's own
    ``chunk_indices`` stay.
    """
    if getattr(kernel, "_mh_chunk_indices", False):
        return kernel

    @functools.wraps(kernel)
    def call(*args, cu_seqlens=None, **kwargs):
        if (
            cu_seqlens is not None
            and cu_seqlens.is_cuda
            and kwargs.get("chunk_indices") is None
            and kwargs.get("cp_context") is None
            and kwargs.get("chunk_size", FLA_CHUNK_SIZE) == FLA_CHUNK_SIZE
        ):
            kwargs["chunk_indices"] = fla_chunk_indices(cu_seqlens)
        return kernel(*args, cu_seqlens=cu_seqlens, **kwargs)

    call._mh_chunk_indices = True
    return call


class HybridGatedDeltaNet(GatedDeltaNet):
    """megatron-core's ``GatedDeltaNet`` with ``g`` computed in float32 (see the module doc)."""

    #: The boundaries of the forward under way with fixed-size parameters (:meth:`forward`).
    _fixed_cu_seqlens: torch.Tensor | None = None

    def __init__(self, config, *args, **kwargs):
        fla_kernels = torch.cuda.is_available() and not config.deterministic_mode
        if fla_kernels:
            register_fla_backend()  # fla's backward on Hopper with Triton 3.4-3.7.0
            # megatron-core 0.19.2's gdn.py calls the conv it imported from fla by that module
            # name at run time; the rule it binds to the layer in _setup_variant_attrs.
            if megatron_gdn.causal_conv1d is not None:
                megatron_gdn.causal_conv1d = _with_chunk_indices(megatron_gdn.causal_conv1d)
        super().__init__(config, *args, **kwargs)
        rule = self.gated_delta_rule
        # megatron binds fla's rule here (the CPU runtime's stand-in in its place, which takes the
        # same grouped heads); the torch paths of deterministic_mode need one key head per value
        # head.
        self.rule_takes_key_heads = rule is not None and rule is megatron_gdn.chunk_gated_delta_rule
        if fla_kernels and self.rule_takes_key_heads:
            self.gated_delta_rule = _with_chunk_indices(rule)

    @property
    def reads_fixed_packed_on_device(self) -> bool:
        """Whether packed calls take fixed-size boundaries (CUDA graphs of packed rows): where
        fla's rule is bound (or the CPU runtime's stand-in, with its contract), which reads the
        boundaries and the chunk table on the device; megatron's torch path of
        ``deterministic_mode`` takes no packed rows."""
        return self.rule_takes_key_heads and not self.config.deterministic_mode

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """megatron-core's forward; with fixed-size packed parameters
        (:class:`~megatron_hybrid.padding.fixed.FixedPackedSeqParams`, a graphed piece's packed
        call) on :func:`fixed_fla_boundaries`, with no host read.

        Raises:
            ValueError: fixed-size parameters where the rule cannot take them, or for a row of
                another length.
        """
        if isinstance(packed_seq_params, FixedPackedSeqParams):
            rows = hidden_states.shape[0] * self.sp_size * self.cp_size
            if not self.reads_fixed_packed_on_device or packed_seq_params.total_tokens != rows:
                raise ValueError(
                    f"GatedDeltaNet: fixed-size packed boundaries for rows of "
                    f"{packed_seq_params.total_tokens} tokens, given {rows} rows"
                    + ("" if self.reads_fixed_packed_on_device else " and a rule without fla's")
                    + "; pass the micro-batch's own PackedSeqParams"
                )
            self._fixed_cu_seqlens = fixed_fla_boundaries(packed_seq_params)
        try:
            return super().forward(
                hidden_states,
                attention_mask,
                inference_context,
                packed_seq_params,
                sequence_len_offset,
                **kwargs,
            )
        finally:
            self._fixed_cu_seqlens = None

    def _prepare_input_for_gated_delta_rule(
        self, qkv: torch.Tensor, gate: torch.Tensor, batch: int, seq_len: int, *gate_feats
    ) -> tuple[torch.Tensor, ...]:
        """megatron-core's split, reshape and l2 norm of the convolved ``qkv`` (0.19.2's
        ``ssm/gated_delta_net/common.py``), without repeating the query/key heads where the rule
        shares them among the value heads itself (:attr:`rule_takes_key_heads`).

        Returns ``(query, key, value, gate, *gate_feats)``, contiguous: query and key
        ``[batch, seq_len, H, K]`` with ``H`` this rank's key heads, value
        ``[batch, seq_len, HV, V]``.
        """
        if not self.rule_takes_key_heads or self.num_value_heads == self.num_key_heads:
            return super()._prepare_input_for_gated_delta_rule(
                qkv, gate, batch, seq_len, *gate_feats
            )
        query_key, value = torch.split(
            qkv,
            [2 * self.qk_dim_local_tp // self.cp_size, self.v_dim_local_tp // self.cp_size],
            dim=-1,
        )
        query_key = query_key.reshape(batch, seq_len, -1, self.key_head_dim)
        if self.use_qk_l2norm:
            # Looked up at call time: the CPU runtime installs its torch l2norm there.
            query_key = megatron_gdn_common.l2norm(query_key.contiguous())
        query, key = query_key.chunk(2, dim=2)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        return tuple(t.contiguous() for t in (query, key, value, gate, *gate_feats))

    @jit_fuser
    def _compute_g_and_beta(
        self,
        A_log_local_cp: torch.Tensor,  # noqa: N803 - megatron-core's argument names
        dt_bias_local_cp: torch.Tensor,
        alpha: torch.Tensor,
        beta: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``g = -exp(A_log) * softplus(alpha + dt_bias)`` in float32, ``beta = sigmoid(beta)``."""
        decay = A_log_local_cp.float().exp()
        g = -decay * softplus(alpha.float() + dt_bias_local_cp.float())
        return g, beta.sigmoid()

    def _resolve_cu_seqlens(
        self, cu_seqlens_padded, cu_seqlens_actual, total_seq_len, name, cp_size: int = 1
    ) -> torch.Tensor:
        """megatron-core's checks of a packed batch's boundaries (``_GDNBase``, 0.19.2's
        ``ssm/gated_delta_net/common.py``) on host values read once per tensor.

        megatron reads ``cu_seqlens[-1]`` and tests the lengths' divisibility on the device:
        three host synchronisations per layer and micro-batch. The boundaries are one tensor
        that every layer receives, so :func:`~megatron_hybrid.padding.batch.host_values` reads
        them once (or never, where the batch came from the host). Fixed-size boundaries
        (:meth:`forward`) are read by nobody: they end at the row's length by construction, and
        context parallelism has none. Both calls return one tensor, so megatron's
        ``torch.equal`` of the two compares a tensor with itself (no device read).
        """
        fixed = getattr(self, "_fixed_cu_seqlens", None)  # a function of its arguments otherwise
        if fixed is not None:
            return fixed
        cu_seqlens = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens_actual
        offsets = host_values(cu_seqlens)
        if offsets[-1] != total_seq_len:
            raise ValueError(
                f"GDN: {name}[-1]={offsets[-1]} does not match total_sequence_length="
                f"{total_seq_len} (cu_seqlens_padded={cu_seqlens_padded}, "
                f"cu_seqlens_actual={cu_seqlens_actual})."
            )
        lengths = [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
        if any(n % cp_size for n in lengths):
            raise ValueError(
                f"All per-sequence lengths in cu_seqlens must be divisible by cp_size={cp_size}, "
                f"but got lengths: {lengths}"
            )
        return cu_seqlens

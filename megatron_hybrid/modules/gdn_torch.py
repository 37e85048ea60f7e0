"""Torch stand-ins for fla's GatedDeltaNet kernels, with fla's calling contract (packed rows too).

megatron-core 0.19.2's ``GatedDeltaNet`` (``ssm/gated_delta_net/gdn.py``) calls three fla
functions: ``l2norm`` on queries and keys, ``causal_conv1d`` on q/k/v and
``chunk_gated_delta_rule``. The last two take ``cu_seqlens`` for packed (THD) rows and restart the
conv window and the recurrent state at every sequence start. fla runs them as Triton kernels,
which have no CPU driver; megatron's own torch path (``deterministic_mode``) takes no
``cu_seqlens`` at all and refuses packed input. The functions here compute what fla's compute,
with fla's signatures, in torch:

* :func:`causal_conv1d`: a depthwise causal ``F.conv1d`` per packed sequence (zero history at
  each start), then the activation;
* :func:`chunk_gated_delta_rule`: megatron's ``torch_chunk_gated_delta_rule`` once per packed
  sequence (zero state at each start), with fla's grouped value heads (``HV`` value heads reading
  ``H`` query/key heads, value head ``i`` reading key head ``i // (HV // H)``);
* :func:`l2norm`: ``x / sqrt(sum(x^2) + eps)`` over the last dimension, in float32.

Each packed sequence therefore gets exactly the computation it gets alone; an empty one (fixed-size
boundaries pad with them) owns no rows and adds nothing. The CPU runtime
(:mod:`megatron_hybrid.runtime.cpu`) installs them into megatron's GatedDeltaNet module with
:func:`install`; that is the one place packed GatedDeltaNet differs between CPU and GPU (on GPUs
megatron calls fla itself, with the same ``cu_seqlens``).
"""

from __future__ import annotations

import torch
from torch.nn.functional import conv1d, pad, silu

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "install", "l2norm", "sequence_spans"]

_ACTIVATIONS = {None: lambda x: x, "silu": silu, "swish": silu}


def sequence_spans(cu_seqlens: torch.Tensor | None, total: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every sequence of a packed row (the whole row without ``cu_seqlens``).

    Raises:
        ValueError: ``cu_seqlens`` does not start at 0, decreases, or does not end at ``total``.
    """
    if cu_seqlens is None:
        return [(0, total)]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    steps = zip(bounds, bounds[1:], strict=False)
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in steps):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the packed length {total}, got {bounds[:8]}"
            f"{' ...' if len(bounds) > 8 else ''}"
        )
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _refuse_packed_batch(x: torch.Tensor, cu_seqlens, name: str) -> None:
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(
            f"{name}: packed input (cu_seqlens) is one row, [1, T, ...]; got batch {x.shape[0]}"
        )


def l2norm(
    x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """fla's ``l2norm``: ``x`` divided by its L2 norm over the last dimension (float32 math)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool | None = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    **unused_kernel_options,
) -> tuple[torch.Tensor, None]:
    """fla's ``causal_conv1d`` on ``[B, T, D]`` input: depthwise, causal, per packed sequence.

    Output step ``t`` of channel ``d`` is ``sum_j weight[d, j] * x[t - W + 1 + j, d] + bias[d]``
    with ``x`` zero before the start of ``t``'s sequence, then the activation; the arithmetic runs
    in ``x``'s dtype, as megatron's ``F.conv1d`` path does.

    Args:
        x: input ``[B, T, D]`` (``B == 1`` with ``cu_seqlens``).
        weight: one filter per channel, ``[D, W]``.
        bias: optional ``[D]``.
        residual: not supported (megatron passes none).
        initial_state: not supported (megatron passes none).
        output_final_state: must be False (megatron asks for none).
        activation: ``None``, ``"silu"`` or ``"swish"``.
        cu_seqlens: boundaries of the packed sequences, or None.
        **unused_kernel_options: fla's kernel choices (``backend``, ``cu_seqlens_cpu``, ...).

    Returns:
        ``(y, None)``: ``y`` ``[B, T, D]`` in ``x``'s dtype, no final state.

    Raises:
        ValueError: an unsupported argument, mismatched shapes, or bad ``cu_seqlens``.
    """
    if residual is not None or initial_state is not None or output_final_state:
        raise ValueError(
            "the torch causal_conv1d stand-in takes no residual, initial_state or final state "
            "(megatron's GatedDeltaNet passes none)"
        )
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(map(str, _ACTIVATIONS))}")
    if x.dim() != 3 or weight is None or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        shape = None if weight is None else tuple(weight.shape)
        raise ValueError(f"need x [B, T, D] and weight [D, W], got {tuple(x.shape)}, {shape}")
    _refuse_packed_batch(x, cu_seqlens, "causal_conv1d")
    channels, width = weight.shape
    filters = weight.unsqueeze(1).to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    pieces = []
    for start, end in sequence_spans(cu_seqlens, x.shape[1]):
        if start == end:  # an empty sequence (fixed-size boundaries) has no output
            continue
        # Left padding only: step t sees its own sequence's x[t - W + 1 .. t] and nothing else.
        segment = pad(x[:, start:end].transpose(1, 2), (width - 1, 0))
        pieces.append(conv1d(segment, filters, bias, groups=channels))
    y = torch.cat(pieces, dim=-1) if len(pieces) != 1 else pieces[0]
    return _ACTIVATIONS[activation](y).transpose(1, 2), None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **unused_kernel_options,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule``: megatron's torch chunked rule once per packed sequence.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g (log decay), beta: ``[B, T, HV]``. With
            ``HV > H`` (fla's grouped value attention, ``HV`` a multiple of ``H``) value head
            ``i`` reads query/key head ``i // (HV // H)``, as fla 0.6.0's kernels index them.
        scale: factor on the queries (None: ``K ** -0.5``).
        initial_state: ``[N, HV, K, V]`` per sequence (N = B, or the packed sequences), or None.
        output_final_state: also return the final state of every sequence.
        use_qk_l2norm_in_kernel: l2-normalise q and k first.
        cu_seqlens: boundaries of the packed sequences (``B == 1``), or None.
        **unused_kernel_options: fla's kernel choices (``cu_seqlens_cpu``, ``chunk_indices``).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state``
        ``[N, HV, K, V]`` (float32) or None.

    Raises:
        ValueError: a kernel option the stand-in does not have, ``HV`` not a multiple of ``H``,
            or bad ``cu_seqlens``.
    """
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    unsupported = {
        name
        for name, value in unused_kernel_options.items()
        if name not in ("cu_seqlens_cpu", "chunk_indices") and value not in (None, False)
    }
    if unsupported:
        raise ValueError(f"the torch chunk_gated_delta_rule stand-in has no {sorted(unsupported)}")
    _refuse_packed_batch(q, cu_seqlens, "chunk_gated_delta_rule")
    heads, value_heads = q.shape[2], v.shape[2]
    if value_heads % heads:
        raise ValueError(
            f"chunk_gated_delta_rule: {value_heads} value heads do not share {heads} query/key "
            f"heads evenly (grouped value heads need a multiple of {heads})"
        )
    if value_heads > heads:  # megatron's torch rule takes one key head per value head
        q, k = (t.repeat_interleave(value_heads // heads, dim=2) for t in (q, k))
    if scale is not None:
        # megatron's torch rule always scales by K ** -0.5.
        q = q * (scale * q.shape[-1] ** 0.5)
    spans = sequence_spans(cu_seqlens, q.shape[1])
    rows = [(None, 0, q.shape[1])] if cu_seqlens is None else [(0, a, b) for a, b in spans]
    if initial_state is not None and initial_state.shape[0] != (
        q.shape[0] if cu_seqlens is None else len(spans)
    ):
        raise ValueError(
            f"initial_state holds {initial_state.shape[0]} states for "
            f"{q.shape[0] if cu_seqlens is None else len(spans)} sequences"
        )
    outputs, finals = [], []
    for index, (row, start, end) in enumerate(rows):
        part = slice(start, end)
        pick = slice(None) if row is None else slice(0, 1)
        state = None
        if initial_state is not None:
            state = initial_state if row is None else initial_state[index : index + 1]
        if start == end:  # an empty sequence (fixed-size boundaries): no output, state as given
            outputs.append(q.new_empty(1, 0, *v.shape[2:]))
            finals.append(_empty_sequence_state(q, v, state) if output_final_state else None)
            continue
        out, final = torch_chunk_gated_delta_rule(
            q[pick, part],
            k[pick, part],
            v[pick, part],
            g[pick, part],
            beta[pick, part],
            initial_state=state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        outputs.append(out)
        finals.append(final)
    o = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    return o, torch.cat(finals) if output_final_state else None


def _empty_sequence_state(
    q: torch.Tensor, v: torch.Tensor, state: torch.Tensor | None
) -> torch.Tensor:
    """The final state of an empty sequence: its initial state (zero if none), float32."""
    if state is not None:
        return state.float()
    return q.new_zeros(1, v.shape[2], q.shape[-1], v.shape[-1], dtype=torch.float32)


def install() -> None:
    """Make megatron-core's GatedDeltaNet call these functions instead of fla's (idempotent).

    megatron's ``gdn.py`` binds ``causal_conv1d`` and ``chunk_gated_delta_rule`` at import and
    reads them when a layer is built (the rule) or run (the conv); ``common.py`` holds
    ``l2norm``. Only the CPU runtime calls this: fla's Triton kernels cannot run there.
    """
    try:
        import megatron.core.ssm.gated_delta_net.common as common
        import megatron.core.ssm.gated_delta_net.gdn as gdn
    except ImportError:  # pragma: no cover - megatron without the GDN module
        return
    # The functions stand in for fla entirely, so fla need not be installed.
    common.HAVE_FLA = True
    common.l2norm = l2norm
    common.causal_conv1d = gdn.causal_conv1d = causal_conv1d
    common.chunk_gated_delta_rule = gdn.chunk_gated_delta_rule = chunk_gated_delta_rule

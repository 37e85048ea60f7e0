"""Per-token log-probabilities and entropies from vocab-parallel logits, without gathering them.

With tensor parallelism megatron's output layer leaves every rank the logits of its slice of the
vocabulary (``[..., V / tp]``). :func:`token_logprobs` and :func:`token_entropy` reduce over the
whole vocabulary with small all-reduces over the tensor-parallel group (row maxima, target logits,
sums), as megatron-core's vocab-parallel cross-entropy does (``tensor_parallel/cross_entropy.py``,
``VocabParallelCrossEntropy``): the ``[..., V]`` logits never exist on one rank.

The math is float32 whatever the logits' dtype. Vocabulary rows at and past ``vocab_size``
(megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``) are left out
of the softmax. On CUDA the forward statistics are one Triton pass over each row and the
gradient one more (:mod:`~megatron_hybrid.kernels.vocab_rows`); elsewhere the work runs over
blocks of at most :data:`BLOCK_ELEMENTS` logits, so the memory beyond the input is a few float32
blocks, at most one logits-sized buffer. Both functions are differentiable: the backward pass
recomputes the softmax from the saved logits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from megatron_hybrid.kernels.vocab_rows import (
    combine_shards,
    kernel_reason,
    row_statistics,
    softmax_gradient,
)

__all__ = [
    "BLOCK_ELEMENTS",
    "check_temperature",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
]

#: Logits per block of rows; float32 temporaries of one or two blocks are the extra memory.
BLOCK_ELEMENTS = 1 << 24


def check_temperature(temperature) -> float:
    """``temperature`` as a float, or ValueError unless it is a positive finite number."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    return float(temperature)


def _layout(logits: Tensor, vocab_size, tp_group) -> tuple[int, int]:
    """``(first vocabulary id of this shard, number of its columns that are real tokens)``."""
    if not torch.is_tensor(logits) or not logits.is_floating_point() or logits.dim() < 1:
        got = logits.dtype if torch.is_tensor(logits) else type(logits).__name__
        raise ValueError(f"logits must be a floating-point tensor [..., vocab shard], got {got}")
    rank, size = (0, 1) if tp_group is None else (tp_group.rank(), tp_group.size())
    local = logits.size(-1)
    total = local * size
    vocab_size = total if vocab_size is None else vocab_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if vocab_size > total:
        raise ValueError(
            f"vocab_size={vocab_size} exceeds the {total} logits of the vocabulary ({local} per "
            f"rank x TP {size}); pass this rank's vocabulary shard and the real vocabulary size"
        )
    first = rank * local
    return first, max(0, min(local, vocab_size - first))


def _check_labels(labels, logits: Tensor, vocab_size: int, ids: bool = True) -> None:
    """Refuse labels of the wrong type or shape, and (``ids``) ids outside the vocabulary."""
    if not torch.is_tensor(labels) or labels.dtype.is_floating_point or labels.is_complex():
        raise ValueError("labels must be an integer tensor of token ids")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels {tuple(labels.shape)} must have the logits' shape without the vocabulary "
            f"dimension, {tuple(logits.shape[:-1])}"
        )
    if ids and labels.numel():
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"labels must be token ids in [0, {vocab_size}); got values in [{low}, {high}]"
            )


def _all_reduce(tensor: Tensor, op, tp_group) -> Tensor:
    if tp_group is not None and tp_group.size() > 1:
        torch.distributed.all_reduce(tensor, op=op, group=tp_group)
    return tensor


def _blocks(rows: int, columns: int):
    step = max(1, BLOCK_ELEMENTS // max(columns, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _shifted(flat: Tensor, block: slice, valid: int, temperature: float, shift: Tensor) -> Tensor:
    """``z = logits / T - max`` (float32) of a block of rows over the shard's real columns."""
    x = flat[block, :valid].float()
    x = x / temperature if temperature != 1.0 else x.clone()
    return x.sub_(shift[block].unsqueeze(-1))


def _softmax_statistics(flat: Tensor, valid: int, temperature: float, tp_group, entropy: bool):
    """Per row: the global max of ``logits / T``, ``log S`` with ``S = sum exp(z)`` and, if
    ``entropy``, ``sum exp(z) * z / S`` (``z = logits / T - max``), all reduced over the TP
    group. On CUDA one Triton pass per row (:mod:`~megatron_hybrid.kernels.vocab_rows`);
    elsewhere, and as its reference, :func:`_softmax_statistics_blocks`."""
    if kernel_reason(flat) is None:
        combined = combine_shards(*row_statistics(flat, valid, temperature, entropy), tp_group)
        return combined.shift, combined.total.log(), combined.mean_z
    return _softmax_statistics_blocks(flat, valid, temperature, tp_group, entropy)


def _softmax_statistics_blocks(flat, valid: int, temperature: float, tp_group, entropy: bool):
    """:func:`_softmax_statistics` in torch, over float32 blocks of rows."""
    rows = flat.size(0)
    shift = torch.full((rows,), -math.inf, dtype=torch.float32, device=flat.device)
    for block in _blocks(rows, valid) if valid else ():
        # The maximum is exact in any dtype: no float32 copy of the block for it.
        shift[block] = flat[block, :valid].amax(-1).float() / temperature
    _all_reduce(shift, ReduceOp.MAX, tp_group)
    sums = torch.zeros(2, rows, dtype=torch.float32, device=flat.device)
    for block in _blocks(rows, valid) if valid else ():
        z = _shifted(flat, block, valid, temperature, shift)
        e = z.exp()
        sums[0, block] = e.sum(-1)
        if entropy:
            sums[1, block] = z.mul_(e).sum(-1)
    _all_reduce(sums, ReduceOp.SUM, tp_group)
    return shift, sums[0].log(), sums[1] / sums[0]


def _target_logits(flat, labels, first, valid, temperature, shift, tp_group) -> Tensor:
    """``logits[label] / T - max`` per row, from the rank that holds the label."""
    local = (labels >= first) & (labels < first + valid)
    index = (labels - first).clamp(0, max(valid - 1, 0)).unsqueeze(-1)
    picked = flat.gather(-1, index).squeeze(-1).float() / temperature - shift
    target = torch.where(local, picked, torch.zeros_like(picked))
    return _all_reduce(target, ReduceOp.SUM, tp_group)


class _VocabParallelTerms(torch.autograd.Function):
    """``log p(label)`` (where ``labels`` are given) and the entropy (where ``entropy``) of
    vocab-parallel logits: one pass of softmax statistics forward, one backward pass for
    whichever of the two outputs receives a gradient."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_size, tp_group, entropy: bool):
        first, valid = _layout(logits, vocab_size, tp_group)
        flat = logits.reshape(-1, logits.size(-1))
        shift, log_sum, mean_z = _softmax_statistics(flat, valid, temperature, tp_group, entropy)
        outputs, shape = [], logits.shape[:-1]
        if labels is not None:
            flat_labels = labels.reshape(-1)
            target = _target_logits(flat, flat_labels, first, valid, temperature, shift, tp_group)
            outputs.append((target - log_sum).view(shape))
        # H = -sum p log p with log p = z - log S: H = log S - sum p z.
        entropies = log_sum - mean_z if entropy else None
        if entropy:
            outputs.append(entropies.view(shape))
        ctx.set_materialize_grads(False)  # an output nobody uses costs no backward work
        ctx.save_for_backward(logits, labels, shift, log_sum, entropies)
        ctx.layout = (first, valid, temperature)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        logits, labels, shift, log_sum, entropies = ctx.saved_tensors
        first, valid, temperature = ctx.layout
        grads = list(grads)
        g_lp = grads.pop(0) if labels is not None else None
        g_h = grads.pop(0) if entropies is not None else None
        g_lp = None if g_lp is None else g_lp.reshape(-1).float()
        g_h = None if g_h is None else g_h.reshape(-1).float()
        flat = logits.reshape(-1, logits.size(-1))
        if kernel_reason(flat) is None and (g_lp is not None or g_h is not None):
            grad = _kernel_gradient(flat, labels, first, valid, temperature, shift, log_sum,
                                    entropies, g_lp, g_h)  # fmt: skip
            return grad.view_as(logits), None, None, None, None, None
        out = torch.zeros_like(flat)
        wanted = g_lp is not None or g_h is not None
        for block in _blocks(flat.size(0), valid) if valid and wanted else ():
            # d/dz_i of g_lp * log p(label) + g_h * H, with z = logits / T:
            # g_lp * ([i == label] - p_i) - g_h * p_i * (log p_i + H); the indicator is added
            # below.
            log_p = _shifted(flat, block, valid, temperature, shift + log_sum)
            p = log_p.exp()
            term = None
            if g_lp is not None:
                term = p * (-g_lp[block] / temperature).unsqueeze(-1)
            if g_h is not None:
                scale = (-g_h[block] / temperature).unsqueeze(-1)
                h_term = log_p.add_(entropies[block].unsqueeze(-1)).mul_(p).mul_(scale)
                term = h_term if term is None else term.add_(h_term)
            out[block, :valid] = term.to(out.dtype)
        if g_lp is not None:
            flat_labels = labels.reshape(-1)
            local = (flat_labels >= first) & (flat_labels < first + valid)
            hit = local.nonzero().squeeze(-1)
            out[hit, flat_labels[hit] - first] += (g_lp[hit] / temperature).to(out.dtype)
        return out.view_as(logits), None, None, None, None, None


def _kernel_gradient(flat, labels, first, valid, temperature, shift, log_sum, entropies, g_lp,
                     g_h):  # fmt: skip
    """:class:`_VocabParallelTerms`' gradient as one Triton pass
    (:func:`~megatron_hybrid.kernels.vocab_rows.softmax_gradient`)."""
    rows = flat.size(0)
    target = torch.full((rows,), -1, dtype=torch.int64, device=flat.device)
    if labels is not None:
        local = labels.reshape(-1).to(torch.int64) - first
        target = torch.where((local >= 0) & (local < valid), local, target)
    g_target = torch.zeros(rows, dtype=torch.float32, device=flat.device) if g_lp is None else g_lp
    return softmax_gradient(flat, valid, temperature, target, shift, log_sum.exp(),
                            g_target.contiguous(), None if g_h is None else g_h.contiguous(),
                            None if g_h is None else entropies.contiguous())  # fmt: skip


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    tp_group=None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    check_labels: bool = True,
) -> Tensor:
    """``log softmax(logits / temperature)[label]`` per position, from vocab-parallel logits.

    Args:
        logits: this rank's vocabulary shard, ``[..., V / tp]`` (any float dtype); rank ``r`` of
            ``tp_group`` holds vocabulary ids ``[r * V / tp, (r + 1) * V / tp)``, as megatron's
            ``ColumnParallelLinear`` output layer leaves them.
        labels: token ids ``[...]`` (global ids, the same on every TP rank).
        tp_group: the tensor-parallel group the vocabulary is split over (None: not split).
        temperature: the sampling temperature the log-probabilities are for.
        vocab_size: the real vocabulary size; logits of ids at and past it (vocabulary padding)
            are excluded. None: every column is a token.
        check_labels: check that the labels are ids of the vocabulary (reading their range
            waits for the device); pass False for labels already checked (``forward_logprobs``
            and the RL step do), so that nothing synchronises the host with the device.

    Returns:
        float32 ``[...]`` log-probabilities, the same on every rank of ``tp_group``;
        differentiable with respect to ``logits``.

    Raises:
        ValueError: bad logits, labels (shape, dtype, ids outside the vocabulary), temperature
            or vocab_size.
    """
    temperature = check_temperature(temperature)
    _layout(logits, vocab_size, tp_group)
    size = 1 if tp_group is None else tp_group.size()
    _check_labels(labels, logits, vocab_size or logits.size(-1) * size, check_labels)
    (logprobs,) = _VocabParallelTerms.apply(logits, labels, temperature, vocab_size, tp_group,
                                            False)  # fmt: skip
    return logprobs


def token_entropy(
    logits: Tensor,
    *,
    tp_group=None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> Tensor:
    """Entropy ``-sum p log p`` of ``softmax(logits / temperature)`` per position.

    Args:
        logits: this rank's vocabulary shard ``[..., V / tp]`` (see :func:`token_logprobs`).
        tp_group: the tensor-parallel group the vocabulary is split over (None: not split).
        temperature: the sampling temperature.
        vocab_size: the real vocabulary size (padding columns excluded); None: all columns.

    Returns:
        float32 ``[...]`` entropies in nats, the same on every rank of ``tp_group``;
        differentiable with respect to ``logits``.

    Raises:
        ValueError: bad logits, temperature or vocab_size.
    """
    temperature = check_temperature(temperature)
    _layout(logits, vocab_size, tp_group)
    (entropies,) = _VocabParallelTerms.apply(logits, None, temperature, vocab_size, tp_group,
                                             True)  # fmt: skip
    return entropies


def token_logprobs_and_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    tp_group=None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    check_labels: bool = True,
) -> tuple[Tensor, Tensor]:
    """:func:`token_logprobs` and :func:`token_entropy` together, for the price of one.

    One pass over the logits gives the softmax statistics both need (the row maxima, ``sum
    exp(z)`` and ``sum exp(z) z``), and one backward pass gives the gradient of any combination
    of the two; the numbers are those of the two functions called apart.

    Returns:
        ``(logprobs, entropies)``, float32 ``[...]`` each, differentiable with respect to
        ``logits``.

    Raises:
        ValueError: as :func:`token_logprobs` (``check_labels`` likewise).
    """
    temperature = check_temperature(temperature)
    _layout(logits, vocab_size, tp_group)
    size = 1 if tp_group is None else tp_group.size()
    _check_labels(labels, logits, vocab_size or logits.size(-1) * size, check_labels)
    return _VocabParallelTerms.apply(logits, labels, temperature, vocab_size, tp_group, True)

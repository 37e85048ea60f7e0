"""Apply padding plans to tensors: BSHD pad/unpad and THD pack/unpack.

The planners in :mod:`~megatron_hybrid.padding.multiples` (BSHD) and
:mod:`~megatron_hybrid.padding.thd` (THD) decide lengths; this module only moves tensors. Both
directions are exact: padding then unpadding (or packing then unpacking) returns the caller's
tensors bit for bit, because pads only ever go *after* real tokens and the real tokens are
copied, never recomputed. A batch goes to the GPU through :func:`to_device` (from pinned memory,
the host not waiting), and its boundaries are read on the host once through :func:`host_values`.

Pad values (as Megatron-Bridge's ``training/utils/padding_utils.py`` uses them): tokens the pad
id, ``labels`` -100, ``loss_mask`` 0, ``padding_mask`` True (True = pad, as megatron-core's MoE
code reads it), ``position_ids`` continue each row, a 2D (HF-style, 1 = real) ``attention_mask``
0. Other ``[B, S, ...]`` keys need a value in ``pad_values``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_hybrid.padding.multiples import BshdPlan
from megatron_hybrid.padding.thd import ThdPlan

__all__ = [
    "IGNORE_INDEX",
    "PackedBatch",
    "PaddedBatch",
    "derived",
    "host_values",
    "pack_thd",
    "pad_bshd",
    "per_segment",
    "per_tensor",
    "packed_seq_params_from",
    "packed_seq_params_to",
    "segment_offsets",
    "seq_idx_of",
    "to_device",
    "unpack_thd",
    "unpad_seq",
]

IGNORE_INDEX = -100
_TOKEN_KEYS = ("tokens", "input_ids")
_DEFAULT_PADS: Mapping[str, float | int | bool] = {
    "labels": IGNORE_INDEX,
    "loss_mask": 0,
    "padding_mask": True,
}


def _pad_value(key: str, pad_token_id: int, pad_values: Mapping[str, float | int | bool]) -> object:
    if key in pad_values:
        return pad_values[key]
    if key in _TOKEN_KEYS:
        return pad_token_id
    if key in _DEFAULT_PADS:
        return _DEFAULT_PADS[key]
    raise ValueError(
        f"no pad value for batch key {key!r}: known keys are {_TOKEN_KEYS + tuple(_DEFAULT_PADS)}"
        f", 'position_ids' and 'attention_mask'; pass pad_values={{{key!r}: value}}"
    )


def _token_key(keys: Sequence[str], where: str) -> str:
    for key in _TOKEN_KEYS:
        if key in keys:
            return key
    raise ValueError(f"{where}: the batch needs a 'tokens' or 'input_ids' tensor, got {keys}")


def _extend(x: torch.Tensor, dim: int, extra: int, value: object) -> torch.Tensor:
    """Append ``extra`` entries filled with ``value`` along ``dim``."""
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def _continue_positions(pos: torch.Tensor, extra: int, dim: int) -> torch.Tensor:
    """Continue position ids after the last one, so pads look like a longer sequence (as
    Megatron-Bridge does)."""
    last = pos.narrow(dim, pos.shape[dim] - 1, 1)
    steps = torch.arange(1, extra + 1, dtype=pos.dtype, device=pos.device)
    view = [1] * pos.dim()
    view[dim] = extra
    return torch.cat([pos, last + steps.view(view)], dim=dim)


def _pad_4d_mask(mask: torch.Tensor, length: int, padded: int) -> torch.Tensor:
    """Grow a Megatron ``[B, 1, S, S]`` bool mask (True = masked) to ``padded``.

    New rows are all False (an all-True row makes softmax NaN). The block "real query
    x pad key" is True: leaving it False and relying on the causal mask is not enough, because
    megatron-core's unfused softmax uses a given mask as is (fusions/fused_softmax.py), so real
    tokens would attend to pads there. Under a causal mask the two choices are identical.
    """
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2:] != (length, length):
        raise ValueError(
            f"attention_mask must be a bool [B, 1, {length}, {length}] tensor (True = masked) or "
            f"a 2D [B, {length}] tensor (1 = real); got {tuple(mask.shape)} {mask.dtype}"
        )
    out = mask.new_zeros(*mask.shape[:-2], padded, padded)
    out[..., :length, :length] = mask
    out[..., :length, length:] = True
    return out


@dataclass(frozen=True)
class PaddedBatch:
    """A padded ``[B, S_pad]`` batch and what :meth:`unpad` needs to restore the input.

    Attributes:
        tensors: the padded tensors (always including ``padding_mask``).
        plan: the plan that was applied.
        added_keys: keys this module created (removed again by :meth:`unpad`).
    """

    tensors: dict[str, torch.Tensor]
    plan: BshdPlan
    added_keys: tuple[str, ...]

    def unpad(self) -> dict[str, torch.Tensor]:
        """Return the original batch, bit for bit (views into :attr:`tensors`).

        Raises:
            ValueError: the plan truncated rows, so the cut tokens are gone.
        """
        if self.plan.truncated:
            raise ValueError(
                f"cannot unpad: rows of {self.plan.cur_len} tokens were truncated to the fixed "
                f"length {self.plan.padded_len}; raise seq_length or shorten the samples"
            )
        length = self.plan.cur_len
        out = {}
        for key, x in self.tensors.items():
            if key in self.added_keys:
                continue
            is_mask = key == "attention_mask" and x.dim() == 4
            out[key] = x[..., :length, :length] if is_mask else x[:, :length]
        return out


def pad_bshd(
    batch: Mapping[str, torch.Tensor],
    plan: BshdPlan,
    *,
    pad_token_id: int = 0,
    pad_values: Mapping[str, float | int | bool] | None = None,
    lengths: Sequence[int] | torch.Tensor | None = None,
) -> PaddedBatch:
    """Pad every ``[B, S, ...]`` tensor of ``batch`` to ``plan.padded_len``.

    Args:
        batch: tensors with the batch on dim 0 and the sequence on dim 1; ``tokens`` or
            ``input_ids`` is required, ``attention_mask`` may be 4D bool or 2D.
        plan: from :func:`~megatron_hybrid.padding.bshd_pad` with ``cur_len = S`` and
            ``batch_size = B``.
        pad_token_id: value for the new token columns.
        pad_values: pad values for other keys (overrides the defaults).
        lengths: the real length of each row. Only used when ``batch`` has no
            ``padding_mask``: positions at or after a row's length are marked as pad too.

    Returns:
        A :class:`PaddedBatch`; ``tensors["padding_mask"]`` is always present.

    Raises:
        ValueError: the batch does not match the plan, or a key has no pad value.
    """
    keys = list(batch)
    tokens = batch[_token_key(keys, "pad_bshd")]
    if tokens.dim() < 2 or tuple(tokens.shape[:2]) != (plan.batch_size, plan.cur_len):
        raise ValueError(
            f"pad_bshd: the plan is for [B={plan.batch_size}, S={plan.cur_len}] but the tokens "
            f"are {tuple(tokens.shape)}; call bshd_pad(cur_len=S, batch_size=B, ...) again"
        )
    length, target = plan.cur_len, plan.padded_len
    values = dict(pad_values or {})
    out: dict[str, torch.Tensor] = {}
    added: list[str] = []
    for key, x in batch.items():
        if key == "attention_mask" and x.dim() == 4:
            cut = x[..., :target, :target] if plan.truncated else x
            out[key] = _pad_4d_mask(cut, min(length, target), target)
            continue
        if tuple(x.shape[:2]) != (plan.batch_size, length):
            raise ValueError(
                f"pad_bshd: {key!r} has shape {tuple(x.shape)}, expected [B={plan.batch_size}, "
                f"S={length}, ...] like the tokens"
            )
        if plan.truncated:
            out[key] = x[:, :target]
        elif key == "position_ids" and key not in values:
            out[key] = _continue_positions(x, target - length, dim=1)
        else:
            value = 0 if key == "attention_mask" else _pad_value(key, pad_token_id, values)
            out[key] = _extend(x, 1, target - length, value)
    if "padding_mask" not in out:
        added.append("padding_mask")
        real = torch.as_tensor(
            [length] * plan.batch_size if lengths is None else lengths, device=tokens.device
        )
        if real.shape != (plan.batch_size,):
            raise ValueError(
                f"pad_bshd: lengths must hold one length per row ({plan.batch_size}), got "
                f"shape {tuple(real.shape)}"
            )
        bad = [int(n) for n in real.tolist() if not 0 <= n <= length]
        if bad:
            # Longer would mark pads as tokens; negative would mark a whole row as pad.
            raise ValueError(
                f"pad_bshd: every length must lie in [0, {length}] (the batch's sequence "
                f"length), got {bad[:4]}"
            )
        positions = torch.arange(target, device=tokens.device)
        out["padding_mask"] = positions.unsqueeze(0) >= real.reshape(-1, 1)
    return PaddedBatch(tensors=out, plan=plan, added_keys=tuple(added))


def unpad_seq(tensor: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    """Return the first ``length`` positions along ``dim`` (e.g. logits ``[B, S_pad, V]``)."""
    return tensor.narrow(dim, 0, length)


def packed_seq_params_from(
    plan: ThdPlan, device: torch.device | str | None = None
) -> PackedSeqParams:
    """Build megatron's ``PackedSeqParams`` for a THD plan.

    ``cu_seqlens_*`` are the real boundaries and ``cu_seqlens_*_padded`` the physical offsets
    (always set: GatedDeltaNet and CP read them, and ``total_tokens`` makes megatron-core
    precompute ``seq_idx``, without which Mamba would scan across sequence boundaries).
    """
    real = torch.tensor(plan.cu_seqlens, dtype=torch.int32, device=device)
    padded = torch.tensor(plan.cu_seqlens_padded, dtype=torch.int32, device=device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=real,
        cu_seqlens_kv=real,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=plan.max_seqlen,
        max_seqlen_kv=plan.max_seqlen,
        pad_between_seqs=plan.cu_seqlens != plan.cu_seqlens_padded,
    )
    # Set after construction: given total_tokens, megatron's __post_init__ derives seq_idx
    # itself, with a CPU repeat_interleave that costs the host about 0.5 ms (one parallel region
    # per call); seq_idx_of gives the same tensor from the plan's host values.
    params.total_tokens = plan.total_tokens
    seq_idx = seq_idx_of(plan.cu_seqlens_padded, plan.total_tokens)
    params.seq_idx = seq_idx if device is None else to_device(seq_idx, device)
    return params


def per_segment(values: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """``[sum(lengths)]`` int64 (CPU): ``values[i]`` at each of the ``lengths[i]`` positions of
    segment ``i``, segments in order; an empty segment owns no position.

    ``torch.repeat_interleave(torch.tensor(values), torch.tensor(lengths))``, computed as a
    cumulative sum of the value steps at each segment's first position: torch's CPU
    ``repeat_interleave`` opens a parallel region per call, about 0.5 ms of host time on a
    16-core host (36 calls per ``forward_logprobs`` call of 9 micro-batches, one H200,
    2026-11-28), this one tens of microseconds.

    Raises:
        ValueError: a negative length, or ``values`` and ``lengths`` of different sizes.
    """
    if len(values) != len(lengths):
        raise ValueError(f"per_segment: {len(values)} values for {len(lengths)} segments")
    if any(n < 0 for n in lengths):
        raise ValueError(f"per_segment: lengths must be >= 0, got {list(lengths)}")
    total = sum(lengths)
    starts = list(itertools.accumulate(lengths, initial=0))[:-1]
    steps = [b - a for a, b in itertools.pairwise([0, *values])]
    # An empty segment's step lands on the next segment's first position (or past the end).
    marks = torch.zeros(total + 1, dtype=torch.long)
    as_long = [torch.tensor(x, dtype=torch.long) for x in (starts, steps)]
    marks.index_add_(0, *as_long)
    return marks[:total].cumsum(0)


def segment_offsets(lengths: Sequence[int]) -> torch.Tensor:
    """``[sum(lengths)]`` int64 (CPU): each position's offset inside its own segment, segments
    of ``lengths`` in order (``0 .. n - 1`` per segment of ``n``; :func:`per_segment`'s cost)."""
    starts = list(itertools.accumulate(lengths, initial=0))[:-1]
    return torch.arange(sum(lengths)) - per_segment(starts, lengths)


def seq_idx_of(cu_seqlens: Sequence[int], total_tokens: int) -> torch.Tensor:
    """megatron-core's ``PackedSeqParams.seq_idx`` (0.19.2's ``packed_seq_params.py``,
    ``__post_init__``) from host values: ``[1, total]`` int32, the index of the sequence of
    every position, rows after ``cu_seqlens[-1]`` one more sequence; lengths clamped at 0."""
    bounds = [*cu_seqlens, total_tokens]
    lengths = [max(0, b - a) for a, b in itertools.pairwise(bounds)]
    return per_segment(range(len(lengths)), lengths).to(torch.int32).unsqueeze(0)


_DERIVED: dict[int, tuple[weakref.ref, dict]] = {}


def per_tensor(cache: dict, tensor: torch.Tensor) -> dict:
    """``tensor``'s own dict in ``cache``, dropped when the tensor is (keyed by identity, so a
    new tensor at a freed tensor's address starts empty). What goes in it must not refer to
    ``tensor`` (it would keep it alive)."""
    ident = id(tensor)
    entry = cache.get(ident)
    if entry is None or entry[0]() is not tensor:
        entry = (weakref.ref(tensor, lambda _, ident=ident: cache.pop(ident, None)), {})
        cache[ident] = entry
    return entry[1]


def derived(tensor: torch.Tensor, key, make):
    """``make()``, computed once per ``key`` for as long as ``tensor`` lives.

    For facts of a tensor that is never changed in place (a packed batch's boundaries), which
    every layer of a forward asks for again (:func:`per_tensor`).
    """
    memo = per_tensor(_DERIVED, tensor)
    if key not in memo:
        memo[key] = make()
    return memo[key]


def host_values(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``, read once for as long as that tensor lives (never changed in place).

    A packed batch's ``cu_seqlens`` is one tensor that every layer of a forward receives: the
    device-to-host copy (a synchronisation) happens at most once per micro-batch, not once per
    layer, and not at all for a tensor :func:`to_device` moved there from the host.
    """
    return derived(tensor, "host_values", tensor.tolist)


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` on ``device``; a host tensor goes to a GPU without the host waiting for it.

    A copy from pageable host memory makes the host wait until the GPU has run everything queued
    before it (a synchronisation per tensor: five per packed micro-batch of ``forward_logprobs``
    on one H100, 2026-11-28). From pinned memory the copy is queued like a kernel; the pinned
    buffer stays reserved until the copy has run (PyTorch's caching host allocator records it).
    A small host tensor's values are kept for :func:`host_values`.
    """
    device = torch.device(device)
    if tensor.device.type != "cpu" or device.type != "cuda":
        return tensor.to(device)
    moved = tensor.pin_memory().to(device, non_blocking=True)
    if tensor.dim() == 1 and tensor.numel() <= 4096 and not tensor.is_floating_point():
        values = tensor.tolist()
        derived(moved, "host_values", lambda: values)
    return moved


def packed_seq_params_to(params: PackedSeqParams, device) -> PackedSeqParams:
    """``params`` with every tensor field (``cu_seqlens*``, ``seq_idx``) moved to ``device``.

    Fields that are one tensor stay one tensor (``cu_seqlens_q`` is ``cu_seqlens_kv``):
    ``torch.equal`` of a tensor with itself, which megatron-core's GatedDeltaNet asks, needs no
    synchronisation."""
    moved_by_id: dict[int, torch.Tensor] = {}
    moved = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if torch.is_tensor(value):
            if id(value) not in moved_by_id:
                moved_by_id[id(value)] = to_device(value, device)
            moved[f.name] = moved_by_id[id(value)]
    moved_params = copy.copy(params)  # not dataclasses.replace: __post_init__ would redo seq_idx
    for name, value in moved.items():
        setattr(moved_params, name, value)
    return moved_params


@dataclass(frozen=True)
class PackedBatch:
    """Sequences packed into ``[1, T, ...]`` tensors, with their ``PackedSeqParams``.

    Attributes:
        tensors: the packed tensors (always including ``position_ids`` and ``padding_mask``).
        packed_seq_params: megatron's THD metadata (``qkv_format="thd"``).
        plan: the plan that was applied.
        added_keys: keys this module created (removed again by :meth:`unpack`).
    """

    tensors: dict[str, torch.Tensor]
    packed_seq_params: PackedSeqParams
    plan: ThdPlan
    added_keys: tuple[str, ...]

    def unpack(self) -> list[dict[str, torch.Tensor]]:
        """Return the original sequences, bit for bit (views into :attr:`tensors`)."""
        starts, lens = self.plan.cu_seqlens_padded, self.plan.seqlens
        return [
            {
                key: x[0, start : start + n]
                for key, x in self.tensors.items()
                if key not in self.added_keys
            }
            for start, n in zip(starts, lens, strict=False)
        ]


def pack_thd(
    sequences: Sequence[Mapping[str, torch.Tensor]],
    plan: ThdPlan,
    *,
    pad_token_id: int = 0,
    pad_values: Mapping[str, float | int | bool] | None = None,
) -> PackedBatch:
    """Pack per-sequence tensors (sequence on dim 0) into ``[1, T, ...]``.

    Args:
        sequences: one mapping per sequence with the same keys; ``tokens`` or ``input_ids`` is
            required and sets the length ``L_i``.
        plan: from :func:`~megatron_hybrid.padding.thd_pack` with ``seqlens = [L_1, ...]``.
        pad_token_id: value for token pads.
        pad_values: pad values for other keys (overrides the defaults).

    Returns:
        A :class:`PackedBatch`. ``position_ids`` restart at 0 for every sequence when the
        sequences bring none; pads continue them.

    Raises:
        ValueError: the sequences do not match the plan, keys differ between sequences, a key
            has no pad value, or an ``attention_mask`` is given (THD uses ``cu_seqlens``).
    """
    if len(sequences) != len(plan.seqlens):
        raise ValueError(
            f"pack_thd: the plan is for {len(plan.seqlens)} sequences, got {len(sequences)}"
        )
    keys = list(sequences[0]) if sequences else []
    token_key = _token_key(keys, "pack_thd")
    if "attention_mask" in keys:
        raise ValueError(
            "pack_thd: drop 'attention_mask': packed (THD) attention takes its boundaries from "
            "cu_seqlens, and a dense mask over the packed row would be wrong"
        )
    values = dict(pad_values or {})
    pieces: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    device = sequences[0][token_key].device
    for i, (seq, n, p) in enumerate(zip(sequences, plan.seqlens, plan.padded_seqlens, strict=True)):
        if list(seq) != keys:
            raise ValueError(f"pack_thd: sequence {i} has keys {list(seq)}, expected keys {keys}")
        if seq[token_key].shape[0] != n:
            raise ValueError(
                f"pack_thd: sequence {i} has {seq[token_key].shape[0]} tokens, but "
                f"plan.seqlens[{i}] = {n}; plan with the same sequences you pack"
            )
        for key in keys:
            x = seq[key]
            if x.shape[0] != n:
                raise ValueError(f"pack_thd: sequence {i}: {key!r} has {x.shape[0]} rows, not {n}")
            if key == "position_ids" and key not in values:
                pieces[key].append(_continue_positions(x, p - n, dim=0) if p > n else x)
            else:
                pieces[key].append(_extend(x, 0, p - n, _pad_value(key, pad_token_id, values)))
    out = {key: torch.cat(parts).unsqueeze(0) for key, parts in pieces.items()}
    added = []
    padded = plan.padded_seqlens
    offsets = segment_offsets(padded)  # of every packed position inside its own sequence
    if "position_ids" not in out:
        added.append("position_ids")
        out["position_ids"] = to_device(offsets.unsqueeze(0), device)
    if "padding_mask" not in out:
        added.append("padding_mask")
        real = per_segment(plan.seqlens, padded)
        out["padding_mask"] = to_device((offsets >= real).unsqueeze(0), device)
    params = packed_seq_params_from(plan, device=device)
    return PackedBatch(tensors=out, packed_seq_params=params, plan=plan, added_keys=tuple(added))


def unpack_thd(tensor: torch.Tensor, plan: ThdPlan, dim: int = 1) -> list[torch.Tensor]:
    """Split a packed output (``[1, T, ...]`` with ``dim=1``, ``[T, ...]`` with ``dim=0``) into
    the real tokens of each sequence."""
    if tensor.shape[dim] != plan.total_tokens:
        raise ValueError(
            f"unpack_thd: dim {dim} has {tensor.shape[dim]} entries, the plan packs "
            f"{plan.total_tokens} tokens"
        )
    starts = plan.cu_seqlens_padded
    return [tensor.narrow(dim, s, n) for s, n in zip(starts, plan.seqlens, strict=False)]

"""Packed == separate: the check that no state, conv window or mask leaks between sequences.

A packed (THD) forward of sequences ``s_1 .. s_n`` must give, at each sequence's real tokens,
the logits of that sequence run alone (a ``[1, L_i]`` batch). :func:`packing_errors` runs both
and returns the largest difference per sequence; a GatedDeltaNet or Mamba state, a causal conv
or an attention mask that leaks from one sequence into the next shows up as an O(1) difference
in every later sequence. :func:`pack_with_gaps` plans the packed row with alignment padding
between the sequences (the TP / HybridEP padding the planners add), so pads sit between real
tokens as they do in training.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_hybrid.padding import pack_thd, packed_seq_params_to, thd_pack
from megatron_hybrid.padding.batch import packed_seq_params_from

__all__ = [
    "PACKING_LENGTHS",
    "pack_apart",
    "pack_with_gaps",
    "packing_errors",
    "random_sequences",
]

#: Lengths that cover a single token, partial and full GDN chunks and Mamba chunk boundaries.
PACKING_LENGTHS = (1, 5, 17, 30, 9)


def random_sequences(
    lengths: Sequence[int] = PACKING_LENGTHS, vocab_size: int = 128, seed: int = 0
) -> list[torch.Tensor]:
    """One random token sequence per length (ids 1 .. vocab - 1; 0 is the pad id)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=gen) for n in lengths]


def pack_with_gaps(sequences: Sequence[torch.Tensor], *, tp: int = 1, chunk: int = 16):
    """Pack ``sequences`` into one THD row with alignment padding after every sequence.

    The per-sequence multiple is 4 (upstream's TP rule for TP 4) and the total a multiple of
    HybridEP's ``chunk * tp`` and of ``tp`` (sequence parallelism), so the row also splits over
    ``tp`` ranks.

    Returns:
        A :class:`~megatron_hybrid.padding.PackedBatch`.
    """
    plan = thd_pack(
        [len(s) for s in sequences],
        tp=max(4, tp),
        cp=1,
        sp=True,
        hybridep=True,
        chunk=chunk,
        mode="upstream",
    )
    return pack_thd([{"input_ids": s} for s in sequences], plan)


def pack_apart(lengths: Sequence[int], total: int, seed: int = 0):
    """Random sequences of ``lengths`` (:func:`random_sequences`) packed into one row of
    ``total`` tokens, each padded to a multiple of 4 (pad rows between the sequences and after the
    last): rows of one length whatever their sequences, as CUDA graphs replay them.

    Returns:
        A :class:`~megatron_hybrid.padding.PackedBatch`.
    """
    plan = thd_pack(lengths, tp=4, cp=1, sp=True, hybridep=False, force_total=total)
    return pack_thd([{"input_ids": s} for s in random_sequences(lengths, seed=seed)], plan)


def packing_errors(
    model,
    sequences: Sequence[torch.Tensor],
    packed=None,
    *,
    packed_position_ids=None,
    align: int = 1,
    leak: bool = False,
) -> list[float]:
    """Max abs difference per sequence between its packed logits and its logits alone.

    Args:
        model: a language model (``model(input_ids, position_ids, attention_mask, ...)``).
        sequences: the token sequences.
        packed: their :class:`~megatron_hybrid.padding.PackedBatch` (default:
            :func:`pack_with_gaps`).
        packed_position_ids: position ids for the packed row instead of the packer's (a
            negative control passes ids that do not restart per sequence).
        align: a sequence run alone is padded (after its tokens, masked) to a multiple of this,
            e.g. the TP size under sequence parallelism.
        leak: negative control: tell the model the packed row is one sequence (every state,
            conv window and attention mask then runs across the boundaries).
    """
    packed = pack_with_gaps(sequences) if packed is None else packed
    device = next(model.parameters()).device
    tensors = {k: v.to(device) for k, v in packed.tensors.items()}
    positions = tensors["position_ids"] if packed_position_ids is None else packed_position_ids
    params = packed.packed_seq_params
    if leak:
        params = packed_seq_params_from(thd_pack([packed.plan.total_tokens], tp=1, cp=1, sp=False))
    with torch.no_grad():
        together = model(
            tensors["input_ids"],
            positions.to(device),
            None,
            packed_seq_params=packed_seq_params_to(params, device),
            padding_mask=tensors["padding_mask"],
        )
        errors = []
        for tokens, start in zip(sequences, packed.plan.cu_seqlens_padded, strict=False):
            n = len(tokens)
            width = -(-n // align) * align
            ids = torch.cat([tokens, tokens.new_zeros(width - n)]).unsqueeze(0).to(device)
            pads = (torch.arange(width) >= n).unsqueeze(0).to(device)
            positions = torch.arange(width, device=device).unsqueeze(0)
            alone = model(ids, positions, None, padding_mask=pads)
            part = together[0, start : start + n]
            errors.append((part.float() - alone[0, :n].float()).abs().max().item())
    return errors

"""Deterministic synthetic variable-length token data, padded through ``megatron_hybrid.padding``.

The embedded default data set needs no download: sequences follow a sparse first-order Markov
chain (every token has two likely successors), so a small model learns it within a few dozen
steps and the loss visibly falls. Sequence ``i`` depends only on ``(seed, i)``, so any step of
any data-parallel rank can be regenerated — which makes resuming exact.

Micro-batches are laid out as padded ``[B, S]`` rows (BSHD) by default, aligned to what TP/SP,
CP, FP8 and HybridEP need, or packed into one ``[1, T]`` row (THD) when the model's layers
accept packed input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from megatron_hybrid.padding import PaddingConfig, equalize_bshd, equalize_thd, pack_thd, pad_bshd

__all__ = ["MicroBatchBuilder", "SyntheticTokens"]

PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class SyntheticTokens:
    """Variable-length sequences from a fixed sparse Markov chain.

    Attributes:
        vocab_size: vocabulary size (token 0 is reserved for padding).
        max_length: longest sequence in tokens (inputs; one more token is drawn for the labels).
        seed: data seed.
        min_length: shortest sequence.
    """

    vocab_size: int
    max_length: int
    seed: int = 1234
    min_length: int = 8

    def __post_init__(self):
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be at least 4, got {self.vocab_size}")
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(
                f"need 1 <= min_length ({self.min_length}) <= max_length ({self.max_length})"
            )

    @cached_property
    def _successors(self) -> torch.Tensor:
        """The Markov chain's two successors of every token (drawn once per dataset)."""
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randint(1, self.vocab_size, (self.vocab_size, 2), generator=generator)

    def sequence(self, index: int) -> torch.Tensor:
        """Tokens ``[L + 1]`` of sequence ``index`` (inputs are ``[:-1]``, labels ``[1:]``)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        # Log-normal lengths, like pretraining documents, clipped to the allowed range.
        median = max(self.min_length, self.max_length // 2)
        draw = torch.empty(1).log_normal_(math.log(median), 0.6, generator=generator).item()
        length = int(min(self.max_length, max(self.min_length, round(draw))))
        successors = self._successors
        tokens = torch.empty(length + 1, dtype=torch.long)
        tokens[0] = int(torch.randint(1, self.vocab_size, (1,), generator=generator))
        choices = (torch.rand(length, generator=generator) > 0.8).long()
        for i in range(length):
            tokens[i + 1] = successors[tokens[i], choices[i]]
        return tokens


class MicroBatchBuilder:
    """Turns sequence indices into model-ready micro-batches (padded or packed).

    Args:
        data: the sequence source.
        padding: parallel settings that decide the alignment (``padding_config_from``).
        micro_batch_size: sequences per micro-batch.
        seq_length: the fixed length used when the pipeline needs one.
        packed: pack sequences into one THD row instead of padding rows.
        equalize_group: process group whose ranks must see equal token counts (HybridEP).
        device: where to put the tensors.
    """

    def __init__(
        self,
        data: SyntheticTokens,
        padding: PaddingConfig,
        *,
        micro_batch_size: int,
        seq_length: int,
        packed: bool = False,
        equalize_group=None,
        device="cpu",
    ):
        self.data = data
        self.padding = padding
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.packed = packed
        self.equalize_group = equalize_group
        self.device = device

    def build(self, indices: list[int]) -> dict:
        """The micro-batch of the given sequences; ``num_tokens`` counts real tokens and
        ``sequence_lengths`` lists them per sequence (host integers, for the step's FLOPs)."""
        sequences = [self.data.sequence(i) for i in indices]
        batch = self._packed(sequences) if self.packed else self._padded(sequences)
        batch["sequence_lengths"] = [len(s) - 1 for s in sequences]
        batch["num_tokens"] = sum(batch["sequence_lengths"])
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _padded(self, sequences):
        lengths = [len(s) - 1 for s in sequences]
        cur_len = max(lengths)
        force = self.seq_length if self.padding.fixed_length_required else None
        plan = self.padding.bshd(cur_len=cur_len, batch_size=len(sequences), force_len=force)
        if self.equalize_group is not None and self.padding.needs_group_equalize:
            plan = equalize_bshd(plan, self.equalize_group)
        tokens = torch.full((len(sequences), cur_len + 1), PAD_TOKEN_ID, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            tokens[row, : len(sequence)] = sequence
        positions = torch.arange(cur_len).unsqueeze(0).expand(len(sequences), -1).contiguous()
        real = torch.arange(cur_len).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        padded = pad_bshd(
            dict(
                input_ids=tokens[:, :-1].contiguous(),
                labels=tokens[:, 1:].contiguous(),
                position_ids=positions,
                loss_mask=real.float(),
            ),
            plan,
            pad_token_id=PAD_TOKEN_ID,
            lengths=lengths,
        ).tensors
        padded["attention_mask"] = None  # causal masking; pads sit after every real token
        return padded

    def _packed(self, sequences):
        lengths = [len(s) - 1 for s in sequences]
        force = self.seq_length * len(sequences) if self.padding.fixed_length_required else None
        plan = self.padding.thd(lengths, force_total=force)
        if self.equalize_group is not None and self.padding.needs_group_equalize:
            # HybridEP: every rank of the TP x EP group dispatches the same number of tokens.
            plan = equalize_thd(plan, self.equalize_group)
        packed = pack_thd(
            [
                dict(input_ids=s[:-1], labels=s[1:], loss_mask=torch.ones(len(s) - 1))
                for s in sequences
            ],
            plan,
            pad_token_id=PAD_TOKEN_ID,
        )
        batch = dict(packed.tensors)
        batch["packed_seq_params"] = packed.packed_seq_params
        batch["attention_mask"] = None
        return batch

"""What a data source hands the batch builder: one training sample at a time.

A sample is ``L + 1`` token ids (the model reads ``tokens[:-1]`` and predicts ``tokens[1:]``), a
loss mask over the ``L`` predictions, and the lengths of the documents (or document pieces) it
is made of. Sources are indexed by a global sample number, so that any rank can draw any step's
samples and a resume continues from a sample count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["SampleSource", "TokenSample"]


@dataclass(frozen=True)
class TokenSample:
    """One sample.

    Attributes:
        tokens: ``[L + 1]`` token ids.
        loss_mask: ``[L]``, 1 where the prediction of ``tokens[i + 1]`` counts in the loss
            (None: every prediction counts).
        documents: the lengths of the document pieces the ``L`` inputs are made of, in order
            (they sum to ``L``); None: the sample is one document. Packed micro-batches keep the
            pieces apart (each attends only to itself); padded rows keep them in one row.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor | None = None
    documents: tuple[int, ...] | None = None

    def __post_init__(self):
        length = len(self.tokens) - 1
        if length < 1:
            raise ValueError(f"a sample needs at least 2 tokens, got {len(self.tokens)}")
        if self.loss_mask is not None and len(self.loss_mask) != length:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {length} labels")
        if self.documents is not None and (
            sum(self.documents) != length or min(self.documents, default=0) < 1
        ):
            raise ValueError(
                f"documents {self.documents} must be positive lengths summing to {length}"
            )

    @property
    def length(self) -> int:
        """``L``: inputs (and predictions)."""
        return len(self.tokens) - 1

    @property
    def pieces(self) -> tuple[int, ...]:
        """The document lengths, ``(L,)`` for a sample of one document."""
        return self.documents or (self.length,)


class SampleSource(Protocol):
    """A split of a data set, indexed by global sample number."""

    #: The most document pieces one sample holds (packing reserves their alignment padding).
    max_documents_per_sample: int

    def sample(self, index: int) -> TokenSample:
        """Sample ``index`` (any non-negative integer below the source's size)."""

    def describe(self) -> str:
        """What the data is, for the start-up line."""

"""Megatron data sets through megatron-core's own machinery: ``GPTDataset``, blends and splits.

``--data-path [W1] PREFIX1 [W2 PREFIX2 ...]`` and ``--split 98,2,0`` mean what they mean in
Megatron-LM: megatron-core's ``get_blend_from_list`` reads the blend, and
``BlendedMegatronDatasetBuilder`` builds the train/valid/test ``GPTDataset`` of every prefix and
blends them by weight (megatron-core 0.19.2, ``megatron/core/datasets/``). A sample is
``seq_length + 1`` tokens cut from the shuffled documents, as Megatron-LM trains; its samples,
their order and the split are megatron-core's, so a data set trains here as it trains in
Megatron-LM.

:class:`DocumentGPTDataset` is ``GPTDataset`` with two additions: where a loss mask lies beside
the tokens (:mod:`megatron_hybrid.data.files`) a sample's ``loss_mask`` also zeroes the labels
that are not trained on, and every sample says where its document pieces begin (``cu_seqlens``,
megatron-core's ``inter_document_masking`` format) so that packed micro-batches keep documents
apart. Both come from watching which document pieces ``GPTDataset`` itself reads for the sample,
so its sample assembly is used as it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron_hybrid.data.files import DataFileError, loss_mask_prefix
from megatron_hybrid.data.samples import TokenSample

__all__ = [
    "DEFAULT_SPLIT",
    "DocumentGPTDataset",
    "GPTSamples",
    "build_gpt_datasets",
    "check_split",
    "empty_split",
    "parse_data_path",
]

#: Megatron-LM's split when ``--data-path`` comes without ``--split`` (its "legacy default").
DEFAULT_SPLIT = "969, 30, 1"
_SPLITS = ("train", "valid", "test")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(values: Sequence[str], *, flag: str = "--data-path"):
    """The blend ``(prefixes, weights or None)`` of ``--data-path`` values, as megatron-core's
    ``get_blend_from_list`` reads them, after checking their form.

    Raises:
        ValueError: an odd list with weights, a weight that is not a positive number, a prefix
            that looks like a weight.
    """
    values = list(values)
    if not values:
        raise ValueError(f"{flag} needs at least one prefix")
    numbers = [_number(v) for v in values]
    weighted = len(values) % 2 == 0 and numbers[0] is not None
    if weighted:
        weights, prefixes = numbers[0::2], values[1::2]
        bad = [values[2 * i] for i, w in enumerate(weights) if w is None or w <= 0]
        if bad:
            raise ValueError(
                f"{flag}: weight {bad[0]!r} must be a positive number (the form is W1 PREFIX1 "
                "W2 PREFIX2 ...)"
            )
        stray = [p for p in prefixes if _number(p) is not None]
    else:
        stray = [v for v, n in zip(values, numbers, strict=True) if n is not None]
    if stray:
        raise ValueError(
            f"{flag}: {stray[0]!r} stands where a prefix belongs; give PREFIX ... or "
            "W1 PREFIX1 W2 PREFIX2 ... (a weight before every prefix)"
        )
    return get_blend_from_list(values)


def empty_split(files, split: str, *, flag: str = "--split") -> str | None:
    """Why a split of a data set would get no token, or None.

    megatron-core gives each split the documents ``[round(a * n), round(b * n))`` of a data set of
    ``n`` (``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``); a split with a
    share but no token there makes ``GPTDataset`` count epochs forever (its
    ``_get_num_epochs`` adds zero tokens per epoch), so it is refused instead.

    Args:
        files: the data set (:class:`~megatron_hybrid.data.files.PrefixFiles`).
        split: the ``--split`` text.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )

    n, matrix = files.sequences, convert_split_vector_to_split_matrix(check_split(split, flag=flag))
    for name, bookends in zip(_SPLITS, matrix, strict=True):
        if bookends is None:
            continue
        begin, end = int(round(bookends[0] * n)), int(round(bookends[1] * n))
        if not files.lengths[begin:end].sum():
            return (
                f"{flag} {split} leaves the {name} split of {files.prefix} ({n:,} documents) "
                f"no document (megatron-core would build it forever): give the {name} split a "
                "larger share or none (e.g. --split 98,2,0), or use more data"
            )
    return None


def check_split(split: str, *, flag: str = "--split") -> list[float]:
    """The normalised ``train, valid, test`` fractions of a Megatron-LM ``--split``.

    Raises:
        ValueError: not one to three non-negative numbers with a positive sum.
    """
    parts = [p for p in re.split(r"[,/\s]+", split.strip()) if p]
    numbers = [_number(p) for p in parts]
    if not 1 <= len(parts) <= 3 or any(n is None or n < 0 for n in numbers) or not sum(numbers):
        raise ValueError(
            f"{flag} {split!r}: give up to three non-negative proportions for train, "
            "validation and test, e.g. --split 98,2,0"
        )
    numbers += [0.0] * (3 - len(numbers))
    return [n / sum(numbers) for n in numbers]


class _ReadRecorder:
    """What ``GPTDataset`` reads from: an ``IndexedDataset`` (attributes pass through) that notes
    the ``(sequence, offset, length)`` of every piece ``get`` returns, and reads the same pieces
    of the loss mask on request."""

    def __init__(self, tokens, mask=None):
        self.tokens, self.mask = tokens, mask
        self.reads: list[tuple[int, int, int]] = []

    def __getattr__(self, name):
        if name in ("tokens", "mask", "reads") or name.startswith("__"):
            raise AttributeError(name)  # not set yet (unpickling): no recursion
        return getattr(self.tokens, name)

    def __len__(self) -> int:
        return len(self.tokens)

    def get(self, idx, offset: int = 0, length: int | None = None):
        ids = self.tokens.get(idx, offset=offset, length=length)
        self.reads.append((int(idx), int(offset), len(ids)))
        return ids

    def masked(self) -> np.ndarray:
        """The loss mask of the pieces read since :attr:`reads` was cleared."""
        parts = [self.mask.get(i, offset=o, length=n) for i, o, n in self.reads]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


class DocumentGPTDataset(GPTDataset):
    """megatron-core's ``GPTDataset`` plus loss masks and document pieces (see the module doc).

    ``__getitem__`` returns ``GPTDataset``'s sample (``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``, and ``attention_mask`` when the config asks for it) with the loss mask of
    the labels applied to ``loss_mask`` and ``cu_seqlens`` added.
    """

    @staticmethod
    def build_low_level_dataset(dataset_path, config):
        tokens = GPTDataset.build_low_level_dataset(dataset_path, config)
        prefix = loss_mask_prefix(dataset_path)
        mask = None
        if IndexedDataset.exists(prefix):
            mask = IndexedDataset(prefix, multimodal=False, mmap=config.mmap_bin_files)
        return _ReadRecorder(tokens, mask)

    def __getitem__(self, idx):
        recorder = self.dataset
        recorder.reads.clear()
        item = super().__getitem__(idx)
        pieces = [n for _, _, n in recorder.reads]
        read = sum(pieces)
        if recorder.mask is not None and idx is not None:
            trained = np.zeros(read + 1, np.float32)  # a pad token is never trained on
            trained[:read] = recorder.masked()
            labels = torch.from_numpy(trained[1 : 1 + len(item["labels"])])
            item["loss_mask"] = item["loss_mask"] * labels
        if "cu_seqlens" not in item:
            item["cu_seqlens"] = self._cu_seqlens(pieces)
        return item

    def _cu_seqlens(self, pieces: list[int]) -> torch.Tensor:
        """Document boundaries of the sample's inputs, padded with ``seq_length`` to a fixed size
        (megatron-core's ``inter_document_masking`` format)."""
        length = self.config.sequence_length
        if self.config.add_extra_token_to_sequence and pieces:
            pieces = pieces[:-1] + [pieces[-1] - 1]  # the extra token is a label only
        pieces = [n for n in pieces if n]
        short = length - sum(pieces)
        if short > 0:  # a padded sample: the padding joins the last piece, as upstream
            pieces = pieces[:-1] + [pieces[-1] + short] if pieces else [short]
        cu = torch.full((length + 1,), length, dtype=torch.int32)
        cu[: len(pieces) + 1] = torch.tensor(np.cumsum([0, *pieces]), dtype=torch.int32)
        return cu


def gpt_dataset_config(*, blend, split: str, seq_length: int, seed: int, tokenizer, **extra):
    """megatron-core's ``GPTDatasetConfig`` of a ``train`` run: Megatron-LM's defaults
    (``reset_position_ids``, ``reset_attention_mask``, ``eod_mask_loss`` off), no attention mask
    in the samples (the model masks causally)."""
    fields = dict(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    fields.update(extra)
    return GPTDatasetConfig(**fields)


def build_gpt_datasets(config, sizes: Sequence[int | None], dataset_class=None) -> list:
    """``[train, valid, test]`` (None for an empty split) through megatron-core's
    ``BlendedMegatronDatasetBuilder``, built on every rank (rank 0 first: it writes the index
    cache the others then read).

    Raises:
        DataFileError: megatron-core could not write its index cache.
    """
    cls = dataset_class or DocumentGPTDataset
    try:
        return BlendedMegatronDatasetBuilder(cls, list(sizes), lambda: True, config).build()
    except Exception as error:  # megatron-core wraps the OSError of an unwritable cache
        if isinstance(error.__cause__, OSError):
            raise DataFileError(
                f"the data's index cache cannot be written ({error.__cause__}); pass "
                "--data-cache-path DIR (a writable folder)"
            ) from None
        raise


@dataclass(frozen=True)
class GPTSamples:
    """A split of Megatron data (a ``DocumentGPTDataset`` or a ``BlendedDataset`` of them) as a
    sample source.

    Attributes:
        dataset: the split.
        name: what it is, for the start-up line.
    """

    dataset: object
    name: str

    def sample(self, index: int) -> TokenSample:
        if index >= len(self.dataset):
            raise IndexError(
                f"sample {index} is beyond the {len(self.dataset)} samples built for {self.name}"
            )
        item = self.dataset[index]
        tokens = torch.cat([item["tokens"], item["labels"][-1:]])
        cu = item["cu_seqlens"].tolist()
        length = len(item["tokens"])
        bounds = [b for i, b in enumerate(cu) if i == 0 or b > cu[i - 1]]
        documents = tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))
        if sum(documents) != length:  # cannot happen for a DocumentGPTDataset item
            documents = None
        return TokenSample(tokens, item["loss_mask"].float(), documents)

    @property
    def max_documents_per_sample(self) -> int:
        """An upper bound of the document pieces in any sample (from megatron-core's sample
        index: a sample runs from one document offset to the next)."""
        parts = getattr(self.dataset, "datasets", None) or [self.dataset]
        most = 1
        for part in parts:
            index = np.asarray(part.sample_index)
            if len(index) > 1:
                most = max(most, int(np.max(np.diff(index[:, 0]))) + 1)
        return most

    def describe(self) -> str:
        return self.name

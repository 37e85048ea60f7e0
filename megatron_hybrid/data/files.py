"""The files of a data set and the checks ``train`` runs on them before anything is built.

A data set is Megatron-LM's: ``PREFIX.bin`` (token ids, one sequence per document) and
``PREFIX.idx`` (megatron-core's ``IndexedDataset`` index). ``prepare-data`` names them as
Megatron-LM's ``tools/preprocess_data.py`` does, ``{--output-prefix}_{json key}_document``.
A data set of chat rows also has its loss mask beside it, as a second ``IndexedDataset`` of
``uint8`` values with the same sequence and document layout:

    PREFIX_loss_mask.bin / PREFIX_loss_mask.idx     1 where a token is trained on

Megatron-LM's tools read the token files as they are (and train on every token);
:mod:`megatron_hybrid.data.gpt` reads the mask too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "LOSS_MASK_SUFFIX",
    "DataFileError",
    "PrefixFiles",
    "check_prefix",
    "dataset_prefix",
    "describe_size",
    "largest_token_id",
    "loss_mask_prefix",
]

#: Appended to a data set's prefix to name its loss mask.
LOSS_MASK_SUFFIX = "_loss_mask"
#: The first bytes of every megatron-core ``.idx`` file (``indexed_dataset._INDEX_HEADER``).
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


class DataFileError(ValueError):
    """A data set's files are missing, damaged or do not fit the model (the message says which)."""


def dataset_prefix(output_prefix: str, key: str) -> str:
    """The prefix ``prepare-data`` (and Megatron-LM's ``preprocess_data.py``) writes for one
    JSON key: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def loss_mask_prefix(prefix: str) -> str:
    """The prefix of a data set's loss mask."""
    return prefix + LOSS_MASK_SUFFIX


@dataclass(frozen=True)
class PrefixFiles:
    """What :func:`check_prefix` found for one prefix.

    Attributes:
        prefix: the prefix as given.
        dtype: the token ids' numpy dtype.
        sequences: sequences (documents, for data written one sequence per document).
        tokens: tokens in the ``.bin``.
        has_loss_mask: a loss mask lies beside the tokens.
        lengths: every sequence's length (a view of the index file).
    """

    prefix: str
    dtype: type
    sequences: int
    tokens: int
    has_loss_mask: bool
    lengths: np.ndarray = field(default=None, repr=False, compare=False)


def _read_index(prefix: str, flag: str) -> tuple[type, np.ndarray, np.ndarray]:
    """``(dtype, sequence lengths, document indices)`` of ``PREFIX.idx``, checked."""
    idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
    missing = [p for p in (bin_, idx) if not os.path.isfile(p)]
    if missing:
        raise DataFileError(
            f"{flag} {prefix}: {' and '.join(missing)} not found; a data set is PREFIX.bin and "
            "PREFIX.idx (python -m megatron_hybrid prepare-data writes them), so pass the path "
            "without the extension"
        )
    with open(idx, "rb") as stream:
        header = stream.read(9 + 8 + 1 + 8 + 8)
    if len(header) < 34 or header[:9] != _INDEX_MAGIC or header[17] not in _DTYPES:
        raise DataFileError(f"{flag} {prefix}: {idx} is not a megatron-core index file")
    dtype = _DTYPES[header[17]]
    sequences = int.from_bytes(header[18:26], "little")
    documents = int.from_bytes(header[26:34], "little")
    index = np.memmap(idx, mode="r", dtype=np.uint8)
    expected = 34 + sequences * (4 + 8) + documents * 8
    if len(index) < expected:
        raise DataFileError(
            f"{flag} {prefix}: {idx} is truncated ({len(index)} bytes, its header needs "
            f"{expected}); write the data set again"
        )
    lengths = np.frombuffer(index, dtype=np.int32, count=sequences, offset=34)
    doc_offset = 34 + sequences * 12
    doc_indices = np.frombuffer(index, dtype=np.int64, count=documents, offset=doc_offset)
    size = os.path.getsize(bin_)
    need = int(lengths.sum(dtype=np.int64)) * np.dtype(dtype).itemsize
    if size != need:
        raise DataFileError(
            f"{flag} {prefix}: {bin_} has {size} bytes, its index describes {need}; the two "
            "files do not belong together (or one was cut short): write the data set again"
        )
    return dtype, lengths, doc_indices


def check_prefix(prefix: str, *, flag: str = "--data-path") -> PrefixFiles:
    """Check that a data set's files exist, belong together and, where a loss mask lies beside
    them, that it has their layout.

    Raises:
        DataFileError: naming the file and the problem.
    """
    dtype, lengths, documents = _read_index(prefix, flag)
    mask = loss_mask_prefix(prefix)
    has_mask = any(os.path.exists(f"{mask}.{ext}") for ext in ("bin", "idx"))
    if has_mask:
        mask_dtype, mask_lengths, mask_documents = _read_index(mask, flag)
        if mask_dtype is not np.uint8 or not (
            np.array_equal(mask_lengths, lengths) and np.array_equal(mask_documents, documents)
        ):
            raise DataFileError(
                f"{flag} {prefix}: the loss mask {mask}.bin/.idx does not have the tokens' "
                "sequences; it was written for other data: write both again with prepare-data"
            )
    tokens = int(lengths.sum(dtype=np.int64))
    if tokens == 0:
        raise DataFileError(f"{flag} {prefix}: the data set holds no tokens")
    return PrefixFiles(prefix, dtype, len(lengths), tokens, has_mask, lengths)


def largest_token_id(files: PrefixFiles, *, chunk: int = 1 << 26) -> int:
    """The largest token id in ``PREFIX.bin`` (reads the file once, in chunks)."""
    data = np.memmap(f"{files.prefix}.bin", mode="r", dtype=files.dtype)
    largest = 0
    for start in range(0, len(data), chunk):
        largest = max(largest, int(data[start : start + chunk].max()))
    return largest


def describe_size(files: list[PrefixFiles]) -> str:
    """``N documents, M tokens`` over the given prefixes."""
    sequences = sum(f.sequences for f in files)
    tokens = sum(f.tokens for f in files)
    return f"{sequences:,} documents, {tokens:,} tokens"

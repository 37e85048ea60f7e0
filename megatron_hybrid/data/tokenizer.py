"""The tokenizer of a data set: a Hugging Face folder, and the vocabulary the model gets from it.

Data is tokenized once (``prepare-data``) with transformers' ``AutoTokenizer``; training reads
the ids and needs the tokenizer only for its size, its end-of-document and pad ids, and the
identity megatron-core's ``GPTDataset`` keys its index cache on, which
:func:`megatron_tokenizer` provides as megatron-core's own Hugging Face tokenizer.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = [
    "TOKENIZER_FILES",
    "has_tokenizer",
    "load_tokenizer",
    "megatron_tokenizer",
    "tokenizer_size",
    "vocab_size_with_padding",
]

#: Files of which at least one marks a folder that holds a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a Hugging Face tokenizer (one of :data:`TOKENIZER_FILES`)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(folder: str | os.PathLike, *, flag: str = "--tokenizer-model"):
    """transformers' ``AutoTokenizer`` of a local folder (no download).

    Raises:
        ValueError: the folder is missing or holds no tokenizer (naming ``flag``).
        ImportError: transformers is not installed (with the extra to install).
    """
    path = Path(folder)
    if not path.is_dir() or not has_tokenizer(path):
        found = "does not exist" if not path.exists() else "holds no Hugging Face tokenizer"
        raise ValueError(
            f"{flag} {folder} {found} (expected one of {', '.join(TOKENIZER_FILES)}); pass the "
            "folder a model's tokenizer was saved to (save_pretrained)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError(
            f"{flag} needs transformers ({error}): pip install 'megatron_hybrid[data]'"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"{flag} {folder}: the tokenizer does not load: {error}") from None


def tokenizer_size(tokenizer) -> int:
    """Token ids the tokenizer can produce: its vocabulary with added tokens (``len``)."""
    return len(tokenizer)


def vocab_size_with_padding(size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    """The model's vocabulary for a tokenizer of ``size`` ids, padded as Megatron-LM pads it:
    up to a multiple of ``--make-vocab-size-divisible-by`` x TP (Megatron-LM
    ``megatron/training/tokenizer/tokenizer.py``, ``_vocab_size_with_padding``; megatron-core
    0.19.2 ``megatron/core/tokenizers/utils/build_tokenizer.py``, ``vocab_size_with_padding``).

    >>> vocab_size_with_padding(151665, 128, 2)
    151808
    """
    multiple = divisible_by * tensor_parallel
    return math.ceil(size / multiple) * multiple


def megatron_tokenizer(folder: str | os.PathLike):
    """megatron-core's Hugging Face tokenizer of ``folder`` (what ``GPTDatasetConfig`` takes)."""
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=str(folder), metadata_path={"library": "huggingface"}
    )

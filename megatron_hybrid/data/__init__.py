"""Data for ``train``: the built-in synthetic tokens, Megatron data sets and the micro-batches.

- :mod:`~megatron_hybrid.data.prepare`: JSONL files to Megatron's ``.bin``/``.idx``
  (``prepare-data``), chat rows rendered with the tokenizer's chat template
  (:mod:`~megatron_hybrid.data.chat`) and their assistant-only loss masks stored beside the
  tokens (:mod:`~megatron_hybrid.data.files`);
- :mod:`~megatron_hybrid.data.gpt`: megatron-core's ``GPTDataset``, blends and splits
  (``BlendedMegatronDatasetBuilder``), reading those loss masks;
- :mod:`~megatron_hybrid.data.synthetic`: the built-in default, which needs no files;
- :mod:`~megatron_hybrid.data.batches`: the one builder of padded and packed micro-batches.

Importing this package loads neither torch nor megatron; the names below load their module on
first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "TokenSample": "samples",
    "SampleSource": "samples",
    "SyntheticTokens": "synthetic",
    "SyntheticSamples": "synthetic",
    "MicroBatch": "batches",
    "build_micro_batch": "batches",
    "packed_token_budget": "batches",
    "ChatRenderer": "chat",
    "PrepareOptions": "prepare",
    "prepare_data": "prepare",
    "DataFileError": "files",
    "check_prefix": "files",
    "dataset_prefix": "files",
    "loss_mask_prefix": "files",
    "DocumentGPTDataset": "gpt",
    "GPTSamples": "gpt",
    "build_gpt_datasets": "gpt",
    "parse_data_path": "gpt",
    "load_tokenizer": "tokenizer",
    "vocab_size_with_padding": "tokenizer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

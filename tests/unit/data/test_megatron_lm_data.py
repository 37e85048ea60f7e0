"""Megatron-LM's script (``training/megatron_lm.py``) builds its data from Megatron-LM's own flags
as ``pretrain_gpt.py`` does; synthetic tokens only with ``--mock-data``. Megatron-LM itself is
not installed here: its parsed flags are a namespace with its names and defaults."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from data_helpers import random_documents, write_indexed

from megatron_hybrid.data.files import loss_mask_prefix


def megatron_lm_args(tokenizer_dir, tmp_path, **data) -> argparse.Namespace:
    """What Megatron-LM's parser gives for its data and tokenizer flags (its defaults)."""
    values = dict(
        seed=1234, seq_length=16, split=None, data_path=None, data_args_path=None,
        train_data_path=None, valid_data_path=None, test_data_path=None,
        per_split_data_args_path=None, data_cache_path=str(tmp_path / "cache"),
        mmap_bin_files=True, mock_data=False, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask_in_dataloader=True,
        num_dataset_builder_threads=1, mid_level_dataset_surplus=0.005,
        allow_ambiguous_pad_tokens=False, multiple_validation_sets=False, full_validation=False,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tokenizer_dir),
        chat_template=None, vocab_file=None, merge_file=None, special_tokens=None,
        tokenizer_hf_no_use_fast=False, tokenizer_hf_no_include_special_tokens=False,
        trust_remote_code=False, metadata_path=None, pad_vocab_size=False,
        padded_vocab_size=512,
    )  # fmt: skip
    values.update(data)
    return argparse.Namespace(**values)


def test_datasets_as_pretrain_gpt_builds_them(tokenizer_dir, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    from megatron_hybrid.training.megatron_lm import datasets_from_args

    documents = random_documents(80, 500, seed=4)
    a = write_indexed(tmp_path / "a", documents)
    write_indexed(loss_mask_prefix(a), [d % 2 for d in documents], dtype=np.uint8)
    b = write_indexed(tmp_path / "b", random_documents(50, 500, seed=5))
    args = megatron_lm_args(tokenizer_dir, tmp_path, data_path=["2", a, "1", b], split="90,8,2")
    sizes = [30, 6, 2]
    ours = datasets_from_args(args, sizes)
    # pretrain_gpt.py's core_gpt_dataset_config_from_args and its builder call, written out.
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=16, blend=([a, b], [2.0, 1.0]), split="90,8,2",
        path_to_cache=str(tmp_path / "reference"), tokenizer=build_tokenizer(args),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=True,
    )  # fmt: skip
    theirs = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    for split in range(3):
        assert len(ours[split]) == len(theirs[split])
        for i in range(len(ours[split])):
            got, want = ours[split][i], theirs[split][i]
            for key in ("tokens", "labels", "position_ids", "attention_mask", "dataset_id"):
                assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key]))
            # The loss mask beside prefix a applies (its parity oracle); b trains on all.
            parity = (want["labels"] % 2).float() if int(want["dataset_id"]) == 0 else 1.0
            assert torch.equal(got["loss_mask"], want["loss_mask"] * parity)


def test_mock_data_only_when_asked(tokenizer_dir, tmp_path):
    from megatron_hybrid.training.megatron_lm import SyntheticLMDataset, datasets_from_args

    args = megatron_lm_args(tokenizer_dir, tmp_path, mock_data=True)
    splits = datasets_from_args(args, [4, 2, 1])
    assert all(isinstance(d, SyntheticLMDataset) for d in splits)
    # One chain (the same successor table), other sequences in each split.
    assert len({d.samples.tokens for d in splits}) == 1
    firsts = [d[0]["input_ids"] for d in splits]
    assert not any(torch.equal(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])
    with pytest.raises(ValueError, match="no training data: pass --data-path PREFIX ...") as error:
        datasets_from_args(megatron_lm_args(tokenizer_dir, tmp_path), [4, 2, 1])
    assert "--mock-data" in str(error.value)

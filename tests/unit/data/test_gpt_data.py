"""``--data-path``/``--split`` are Megatron-LM's: the samples of every split and blend equal
megatron-core's own ``BlendedMegatronDatasetBuilder`` over ``GPTDataset``; a loss mask beside the
tokens zeroes exactly the labels it marks; damaged or foreign files are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from data_helpers import random_documents, write_indexed

from megatron_hybrid.data.files import DataFileError, check_prefix, loss_mask_prefix
from megatron_hybrid.data.gpt import (
    GPTSamples,
    build_gpt_datasets,
    check_split,
    gpt_dataset_config,
    parse_data_path,
)

SEQ = 16


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt")
    return [
        write_indexed(folder / "a", random_documents(60, 500, seed=1)),
        write_indexed(folder / "b", random_documents(90, 500, seed=2, lengths=(1, 25))),
    ]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from megatron_hybrid.data.tokenizer import megatron_tokenizer

    return megatron_tokenizer(tokenizer_dir)


def _config(blend, tokenizer, tmp_path, seed=5, split="80,15,5", **extra):
    return gpt_dataset_config(
        blend=blend,
        split=split,
        seq_length=SEQ,
        seed=seed,
        tokenizer=tokenizer,
        path_to_cache=str(tmp_path),
        **extra,
    )


def _megatron(blend, tokenizer, tmp_path, sizes, **extra):
    """The reference: megatron-core's builder over megatron-core's own GPTDataset."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    config = _config(blend, tokenizer, tmp_path / "reference", **extra)
    return build_gpt_datasets(config, sizes, dataset_class=GPTDataset)


@pytest.mark.parametrize(
    "data_path",
    [pytest.param(["{a}"], id="one_prefix"), pytest.param(["0.3", "{a}", "0.7", "{b}"], id="blend"),
     pytest.param(["{a}", "{b}"], id="blend_by_size")],
)  # fmt: skip
def test_samples_equal_megatron_cores_builder(prefixes, tokenizer, tmp_path, data_path):
    values = [v.format(a=prefixes[0], b=prefixes[1]) for v in data_path]
    blend = parse_data_path(values)
    sizes = [40, 10, 4]
    ours = build_gpt_datasets(_config(blend, tokenizer, tmp_path / "ours"), sizes)
    theirs = _megatron(blend, tokenizer, tmp_path, sizes)
    documents = _megatron(blend, tokenizer, tmp_path, sizes, inter_document_masking=True)
    for split in range(3):
        assert len(ours[split]) == len(theirs[split])
        for i in range(len(ours[split])):
            got, want = ours[split][i], theirs[split][i]
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(got[key], want[key]), (split, i, key)
            assert torch.equal(got["cu_seqlens"], documents[split][i]["cu_seqlens"])
    # Control: another seed (another shuffle) gives other samples; the comparison notices.
    other = build_gpt_datasets(_config(blend, tokenizer, tmp_path / "other", seed=6), sizes)
    assert not all(torch.equal(other[0][i]["tokens"], theirs[0][i]["tokens"]) for i in range(40))


def test_loss_mask_zeroes_the_labels_it_marks(prefixes, tokenizer, tmp_path):
    """An independent oracle: a mask that is each token's parity must leave exactly the odd
    labels in the loss."""
    documents = random_documents(50, 500, seed=3)
    prefix = write_indexed(tmp_path / "c", documents)
    write_indexed(loss_mask_prefix(prefix), [d % 2 for d in documents], dtype=np.uint8)
    assert check_prefix(prefix).has_loss_mask
    train, valid, _ = build_gpt_datasets(
        _config(parse_data_path([prefix]), tokenizer, tmp_path), [30, 5, 1]
    )
    for dataset in (train, valid):
        for i in range(len(dataset)):
            item = dataset[i]
            assert torch.equal(item["loss_mask"], (item["labels"] % 2).float()), i
    # Control: without the mask file every label counts.
    for ext in ("bin", "idx"):
        (tmp_path / f"c_loss_mask.{ext}").unlink()
    train, _, _ = build_gpt_datasets(
        _config(parse_data_path([prefix]), tokenizer, tmp_path / "plain"), [30, 5, 1]
    )
    assert train[0]["loss_mask"].all()


def test_samples_carry_their_document_pieces(prefixes, tokenizer, tmp_path):
    train, _, _ = build_gpt_datasets(
        _config(parse_data_path(prefixes[:1]), tokenizer, tmp_path), [20, 2, 2]
    )
    source = GPTSamples(train, "a")
    for i in range(20):
        sample = source.sample(i)
        assert sample.length == SEQ and sum(sample.pieces) == SEQ
        item = train[i]
        assert torch.equal(sample.tokens[:-1], item["tokens"])
        bounds = np.cumsum([0, *sample.pieces])
        assert item["cu_seqlens"][: len(bounds)].tolist() == bounds.tolist()
    assert 1 < source.max_documents_per_sample <= SEQ
    with pytest.raises(IndexError, match="beyond the"):
        source.sample(len(train))


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (["0.3", "{a}", "0", "{b}"], "weight '0' must be a positive number"),
        (["0.3", "{a}", "x", "{b}"], "weight 'x' must be a positive number"),
        (["{a}", "0.5"], "'0.5' stands where a prefix belongs"),
        (["0.3", "{a}", "0.7"], "'0.3' stands where a prefix belongs"),
    ],
    ids=["zero_weight", "word_weight", "trailing_weight", "odd_blend"],
)
def test_bad_data_path(prefixes, values, match):
    with pytest.raises(ValueError, match=match):
        parse_data_path([v.format(a=prefixes[0], b=prefixes[1]) for v in values])


@pytest.mark.parametrize("split", ["1,2,3,4", "-1,2,0", "0,0,0", "a,b"])
def test_bad_split(split):
    with pytest.raises(ValueError, match="give up to three non-negative proportions"):
        check_split(split)


def test_split_as_megatron_normalises_it():
    assert check_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])
    assert check_split("98,2") == pytest.approx([0.98, 0.02, 0.0])


def test_damaged_files_are_named(prefixes, tmp_path):
    import shutil

    for ext in ("bin", "idx"):
        shutil.copy(f"{prefixes[0]}.{ext}", tmp_path / f"d.{ext}")
    prefix = str(tmp_path / "d")
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:-2])
    with pytest.raises(DataFileError, match=r"d.bin has \d+ bytes, its index describes"):
        check_prefix(prefix)
    (tmp_path / "d.idx").write_bytes(b"not an index at all, really not one")
    with pytest.raises(DataFileError, match="d.idx is not a megatron-core index file"):
        check_prefix(prefix)
    (tmp_path / "d.bin").unlink()
    with pytest.raises(DataFileError, match=r"d.bin not found; a data set is PREFIX.bin"):
        check_prefix(prefix)
    mask = write_indexed(tmp_path / "e", [[1, 2, 3]])
    write_indexed(loss_mask_prefix(mask), [[1, 1]], dtype=np.uint8)
    with pytest.raises(DataFileError, match="does not have the tokens' sequences"):
        check_prefix(mask)

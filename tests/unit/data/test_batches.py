"""The one micro-batch builder: packed THD rows keep document pieces apart at a fixed token
budget, padded rows keep a sample's pieces side by side; both carry the loss mask exactly."""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.data.batches import build_micro_batch, packed_token_budget
from megatron_hybrid.data.samples import TokenSample
from megatron_hybrid.padding import PaddingConfig


def _sample(length: int, documents=None, seed=0, masked=True) -> TokenSample:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 100, (length + 1,), generator=gen)
    mask = (torch.rand(length, generator=gen) > 0.3).float() if masked else None
    return TokenSample(tokens, mask, documents)


SAMPLES = [_sample(12, (5, 4, 3), seed=1), _sample(12, (12,), seed=2), _sample(12, (1, 11), seed=3)]


@pytest.mark.parametrize("cp", [1, 2], ids=["cp1", "cp2"])
def test_packed_keeps_pieces_apart_at_the_budget(cp):
    padding = PaddingConfig(cp=cp)
    budget = packed_token_budget(padding, micro_batch_size=3, seq_length=12, max_documents=3)
    batch = build_micro_batch(SAMPLES, padding, packed=True, fixed_length=budget)
    inputs, params = batch.inputs, batch.inputs["packed_seq_params"]
    assert inputs["input_ids"].shape == (1, budget) and batch.seq_length == budget
    assert params.cu_seqlens_q.tolist() == [0, 5, 9, 12, 24, 25, 36]
    assert batch.num_tokens == 36
    for (sample, first, count), begin, end in zip(
        batch.spans, params.cu_seqlens_q_padded[:-1], params.cu_seqlens_q_padded[1:], strict=True
    ):
        assert first == begin and end - begin >= count
        start = sum(n for s, _, n in batch.spans[: batch.spans.index((sample, first, count))]
                    if s == sample)  # fmt: skip
        tokens, mask = SAMPLES[sample].tokens, SAMPLES[sample].loss_mask
        assert torch.equal(inputs["input_ids"][0, first : first + count],
                           tokens[start : start + count])  # fmt: skip
        assert torch.equal(inputs["labels"][0, first : first + count],
                           tokens[start + 1 : start + count + 1])  # fmt: skip
        assert torch.equal(inputs["loss_mask"][0, first : first + count],
                           mask[start : start + count])  # fmt: skip
        assert inputs["position_ids"][0, first : first + count].tolist() == list(range(count))
        assert inputs["loss_mask"][0, first + count : end].sum() == 0  # pads never count
    assert inputs["loss_mask"].sum() == sum(s.loss_mask.sum() for s in SAMPLES)


def test_padded_rows_keep_a_samples_pieces_side_by_side():
    batch = build_micro_batch(SAMPLES, PaddingConfig(), packed=False)
    inputs = batch.inputs
    assert inputs["packed_seq_params"] is None and inputs["input_ids"].shape == (3, 12)
    for row, sample in enumerate(SAMPLES):
        assert torch.equal(inputs["input_ids"][row], sample.tokens[:-1])
        assert torch.equal(inputs["labels"][row], sample.tokens[1:])
        assert torch.equal(inputs["loss_mask"][row], sample.loss_mask)
        assert inputs["position_ids"][row].tolist() == list(range(12))  # run on, as GPTDataset
    assert batch.labels.shape == (36,)


def test_variable_lengths_pad_after_the_real_tokens():
    samples = [_sample(7, seed=4, masked=False), _sample(3, seed=5, masked=False)]
    padded = build_micro_batch(samples, PaddingConfig(), packed=False, rows=3).inputs
    assert padded["input_ids"].shape == (3, 7)
    assert padded["loss_mask"].sum(dim=1).tolist() == [7, 3, 0]
    assert padded["padding_mask"][1].tolist() == [False] * 3 + [True] * 4
    assert (padded["labels"][1, 3:] == 0).all()


@pytest.mark.parametrize("cp", [1, 2, 4], ids=["cp1", "cp2", "cp4"])
def test_budget_holds_every_layout_of_pieces(cp):
    """However a sample of S tokens splits into at most D pieces, the aligned pack fits T."""
    padding = PaddingConfig(cp=cp)
    gen = torch.Generator().manual_seed(cp)
    budget = packed_token_budget(padding, micro_batch_size=2, seq_length=32, max_documents=6)
    worst = 0
    for trial in range(80):
        samples = []
        for _ in range(2):
            cuts = sorted(torch.randperm(31, generator=gen)[: int(trial % 6)].add(1).tolist())
            pieces = tuple(b - a for a, b in zip([0, *cuts], [*cuts, 32], strict=True))
            samples.append(TokenSample(torch.ones(33, dtype=torch.long), None, pieces))
        lengths = [n for s in samples for n in s.pieces]
        worst = max(worst, padding.thd(lengths).total_tokens)
        build_micro_batch(samples, padding, packed=True, fixed_length=budget)  # never raises
    assert worst <= budget
    if cp == 1:
        assert budget == 64  # no alignment: exactly micro-batch size x sequence length


def test_samples_are_checked():
    with pytest.raises(ValueError, match="documents .* must be positive lengths summing to 4"):
        TokenSample(torch.ones(5, dtype=torch.long), None, (2, 1))
    with pytest.raises(ValueError, match="loss_mask has 3 entries for 4 labels"):
        TokenSample(torch.ones(5, dtype=torch.long), torch.ones(3))
    with pytest.raises(ValueError, match="no samples"):
        build_micro_batch([], PaddingConfig(), packed=True)
    with pytest.raises(ValueError, match="min_length is for padded rows without fixed_length"):
        build_micro_batch(SAMPLES, PaddingConfig(), packed=True, min_length=16)
    with pytest.raises(ValueError, match="min_length is for padded rows without fixed_length"):
        build_micro_batch(SAMPLES, PaddingConfig(), packed=False, fixed_length=16, min_length=16)


@pytest.mark.parametrize("floor", [None, 12, 20], ids=["none", "at-longest", "above"])
def test_min_length_is_a_floor_on_padded_rows(floor):
    batch = build_micro_batch(SAMPLES, PaddingConfig(), packed=False, min_length=floor)
    plain = build_micro_batch(SAMPLES, PaddingConfig(), packed=False)
    width = batch.step_inputs()["input_ids"].shape[1]
    assert width == max(12, floor or 0)
    # The real tokens and their mask are those of the unpadded rows; the rest is padding.
    for key in ("input_ids", "labels", "loss_mask"):
        torch.testing.assert_close(batch.step_inputs()[key][:, :12], plain.step_inputs()[key])
    assert not batch.step_inputs()["loss_mask"][:, 12:].any()

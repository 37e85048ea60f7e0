"""Tensor appliers: exact round trips, pad values and THD metadata (spec §4.3, §5.3)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hybrid.padding import (
    IGNORE_INDEX,
    bshd_pad,
    pack_thd,
    pad_bshd,
    thd_pack,
    unpack_thd,
    unpad_seq,
)

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
parallel = st.fixed_dictionaries(
    {
        "tp": st.sampled_from([1, 2, 4]),
        "cp": st.sampled_from([1, 2, 3]),
        "sp": st.booleans(),
        "quant": st.sampled_from([None, "mxfp8"]),
        "hybridep": st.booleans(),
        "chunk": st.sampled_from([32, 64]),
    }
)


def make_batch(b: int, s: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50_000, (b, s), generator=gen)
    return {
        "tokens": tokens,
        "labels": torch.randint(0, 50_000, (b, s), generator=gen),
        "loss_mask": torch.rand(b, s, generator=gen).round(),
        "position_ids": torch.arange(s).repeat(b, 1),
        "attention_mask": torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(b, 1, s, s),
        "embeds": torch.randn(b, s, 2, 3, generator=gen).to(torch.bfloat16),
    }


@FAST
@given(cfg=parallel, b=st.integers(1, 4), s=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_bshd_round_trip_is_exact(cfg, b, s, seed):
    batch = make_batch(b, s, seed)
    plan = bshd_pad(cur_len=s, batch_size=b, **cfg)
    padded = pad_bshd(batch, plan, pad_token_id=7, pad_values={"embeds": 0.0})
    out = padded.tensors
    s_pad = plan.padded_len
    assert out["tokens"].shape == (b, s_pad) and out["attention_mask"].shape == (b, 1, s_pad, s_pad)
    assert out["embeds"].dtype == torch.bfloat16 and out["embeds"].shape == (b, s_pad, 2, 3)
    # Pad values (spec §4.3).
    assert (out["tokens"][:, s:] == 7).all() and (out["labels"][:, s:] == IGNORE_INDEX).all()
    assert (out["loss_mask"][:, s:] == 0).all()
    assert torch.equal(out["position_ids"], torch.arange(s_pad).repeat(b, 1))
    assert torch.equal(out["padding_mask"], (torch.arange(s_pad) >= s).repeat(b, 1))
    mask = out["attention_mask"]
    assert mask[..., :s, s:].all()  # real queries never see pad keys
    assert not mask.all(dim=-1).any()  # no all-masked row (softmax NaN)
    # Exact inverse.
    restored = padded.unpad()
    assert restored.keys() == batch.keys()
    for key, x in batch.items():
        assert restored[key].dtype == x.dtype and torch.equal(restored[key], x), key


def test_bshd_lengths_mark_collate_padding():
    batch = {"tokens": torch.ones(2, 5, dtype=torch.long)}
    plan = bshd_pad(cur_len=5, batch_size=2, tp=1, cp=1, sp=False, quant="delayed")
    out = pad_bshd(batch, plan, lengths=[5, 3]).tensors
    assert out["padding_mask"].sum(dim=1).tolist() == [11, 13]
    with pytest.raises(ValueError, match="one length per row"):
        pad_bshd(batch, plan, lengths=[5])


@pytest.mark.parametrize("lengths", [[11, 5], [5, -1]], ids=["longer-than-batch", "negative"])
def test_bshd_lengths_must_fit_the_batch(lengths):
    """A length beyond S would mark pads as tokens; a negative one, a whole row as pad."""
    batch = {"tokens": torch.ones(2, 10, dtype=torch.long)}
    plan = bshd_pad(cur_len=10, batch_size=2, tp=1, cp=1, sp=False, quant="delayed")
    with pytest.raises(ValueError, match=r"every length must lie in \[0, 10\]"):
        pad_bshd(batch, plan, lengths=lengths)
    edges = pad_bshd(batch, plan, lengths=[10, 0]).tensors["padding_mask"]  # both ends allowed
    assert edges[:, :10].sum(dim=1).tolist() == [0, 10]


def test_bshd_given_padding_mask_and_2d_mask_are_padded():
    batch = {
        "input_ids": torch.ones(1, 3, dtype=torch.long),
        "padding_mask": torch.tensor([[False, False, True]]),
        "attention_mask": torch.tensor([[1, 1, 0]]),
    }
    plan = bshd_pad(cur_len=3, batch_size=1, tp=4, cp=1, sp=True)
    padded = pad_bshd(batch, plan)
    assert padded.tensors["padding_mask"].tolist() == [[False, False, True, True]]
    assert padded.tensors["attention_mask"].tolist() == [[1, 1, 0, 0]]
    assert padded.added_keys == ()


def test_bshd_truncation_under_fixed_length():
    batch = make_batch(1, 40, seed=0)
    plan = bshd_pad(cur_len=40, batch_size=1, tp=2, cp=1, sp=True, force_len=32)
    padded = pad_bshd(batch, plan, pad_values={"embeds": 0.0})
    assert plan.truncated and padded.tensors["tokens"].shape == (1, 32)
    assert torch.equal(padded.tensors["tokens"], batch["tokens"][:, :32])
    with pytest.raises(ValueError, match="were truncated to the fixed length 32"):
        padded.unpad()


@pytest.mark.parametrize(
    "batch, match",
    [
        ({"labels": torch.ones(1, 4)}, "needs a 'tokens' or 'input_ids'"),
        ({"tokens": torch.ones(1, 5)}, r"plan is for \[B=1, S=4\]"),
        ({"tokens": torch.ones(1, 4), "embeds": torch.ones(1, 4, 2)}, "no pad value for"),
        ({"tokens": torch.ones(1, 4), "loss_mask": torch.ones(2, 4)}, "'loss_mask' has shape"),
        ({"tokens": torch.ones(1, 4), "attention_mask": torch.ones(1, 1, 4, 4)}, "bool"),
    ],
    ids=["no-tokens", "wrong-length", "unknown-key", "wrong-shape", "float-4d-mask"],
)
def test_pad_bshd_errors(batch, match):
    plan = bshd_pad(cur_len=4, batch_size=1, tp=1, cp=1, sp=False)
    with pytest.raises(ValueError, match=match):
        pad_bshd(batch, plan)


def test_unpad_seq_of_model_output():
    logits = torch.randn(2, 16, 5)
    assert torch.equal(unpad_seq(logits, 11), logits[:, :11])


def make_sequences(lens: list[int], seed: int, positions: bool) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lens:
        seq = {
            "tokens": torch.randint(1, 1000, (n,), generator=gen),
            "labels": torch.randint(0, 1000, (n,), generator=gen),
            "loss_mask": torch.rand(n, generator=gen).round().to(torch.bfloat16),
        }
        if positions:
            seq["position_ids"] = torch.arange(n) + 5
        seqs.append(seq)
    return seqs


@FAST
@given(
    cfg=parallel,
    mode=st.sampled_from(["minimal", "upstream", "bridge_vlm"]),
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    positions=st.booleans(),
)
def test_thd_round_trip_is_exact(cfg, mode, lens, seed, positions):
    seqs = make_sequences(lens, seed, positions)
    plan = thd_pack(lens, mode=mode, **cfg)
    packed = pack_thd(seqs, plan, pad_token_id=3)
    out, total = packed.tensors, plan.total_tokens
    assert all(x.shape[:2] == (1, total) for x in out.values())
    real = torch.zeros(total, dtype=torch.bool)
    for start, n in zip(plan.cu_seqlens_padded, lens, strict=False):
        real[start : start + n] = True
    assert torch.equal(out["padding_mask"][0], ~real)
    assert (out["tokens"][0][~real] == 3).all() and (out["labels"][0][~real] == -100).all()
    assert (out["loss_mask"][0][~real] == 0).all()
    # Positions restart per sequence (or continue the given ones) through the pad tail.
    for i, (start, end) in enumerate(
        zip(plan.cu_seqlens_padded, plan.cu_seqlens_padded[1:], strict=False)
    ):
        first = 5 if positions else 0
        assert torch.equal(out["position_ids"][0, start:end], torch.arange(end - start) + first), i
    params = packed.packed_seq_params
    assert params.qkv_format == "thd" and params.total_tokens == total
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == list(plan.cu_seqlens) == params.cu_seqlens_kv.tolist()
    assert params.cu_seqlens_q_padded.tolist() == list(plan.cu_seqlens_padded)
    assert params.max_seqlen_q == params.max_seqlen_kv == plan.max_seqlen
    # megatron-core derives Mamba's seq_idx from the padded boundaries (total_tokens is set).
    assert params.seq_idx.shape == (1, total)
    assert params.seq_idx[0].tolist() == [
        i for i, p in enumerate(plan.padded_seqlens) for _ in range(p)
    ]
    restored = packed.unpack()
    assert len(restored) == len(seqs)
    for got, want in zip(restored, seqs, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    hidden = torch.randn(total, 2)
    parts = unpack_thd(hidden, plan, dim=0)
    assert [p.shape[0] for p in parts] == lens


@pytest.mark.parametrize(
    "seqs, match",
    [
        ([{"tokens": torch.ones(3)}], "the plan is for 2 sequences, got 1"),
        ([{"tokens": torch.ones(3)}, {"tokens": torch.ones(3)}], r"plan.seqlens\[1\]"),
        ([{"tokens": torch.ones(3)}, {"input_ids": torch.ones(2)}], "expected keys"),
        (
            [{"tokens": torch.ones(3), "attention_mask": torch.ones(3)}] * 2,
            "drop 'attention_mask'",
        ),
        (
            [{"tokens": torch.ones(3), "labels": torch.ones(4)}, {"tokens": torch.ones(2)}],
            "'labels' has 4 rows, not 3",
        ),
    ],
    ids=["count", "length", "keys", "attention-mask", "rows"],
)
def test_pack_thd_errors(seqs, match):
    plan = thd_pack([3, 2], tp=1, cp=1, sp=False)
    with pytest.raises(ValueError, match=match):
        pack_thd(seqs, plan)


def test_unpack_thd_checks_length():
    plan = thd_pack([3, 2], tp=1, cp=2, sp=False)
    with pytest.raises(ValueError, match="the plan packs 8 tokens"):
        unpack_thd(torch.zeros(1, 6), plan)


def test_moving_packed_params_keeps_shared_tensors_shared():
    """``cu_seqlens_q`` and ``cu_seqlens_kv`` are one tensor before and after the move (megatron's
    GatedDeltaNet compares them with ``torch.equal``, free for a tensor and itself)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hybrid.padding.batch import packed_seq_params_to

    real = torch.tensor([0, 3, 8], dtype=torch.int32)
    padded = torch.tensor([0, 4, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                             cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                             max_seqlen_q=5, max_seqlen_kv=5)  # fmt: skip
    moved = packed_seq_params_to(params, torch.device("cpu"))
    assert moved.cu_seqlens_q is moved.cu_seqlens_kv
    assert moved.cu_seqlens_q_padded is moved.cu_seqlens_kv_padded
    assert moved.cu_seqlens_q.tolist() == [0, 3, 8] and moved is not params


@FAST
@given(
    lengths=st.lists(st.integers(0, 9), min_size=0, max_size=7),
    seed=st.integers(0, 2**16),
)
def test_per_segment_equals_repeat_interleave(lengths, seed):
    """Empty segments (first, last, adjacent) included: their steps add up where they land."""
    from megatron_hybrid.padding.batch import per_segment

    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-100, 100, (len(lengths),), generator=gen).tolist()
    as_long = [torch.tensor(x, dtype=torch.long) for x in (values, lengths)]
    want = torch.repeat_interleave(*as_long)
    got = per_segment(values, lengths)
    assert got.dtype == torch.long and torch.equal(got, want)


@FAST
@given(lengths=st.lists(st.integers(0, 9), min_size=0, max_size=7))
def test_segment_offsets_count_from_each_segment_start(lengths):
    """Written out position by position; empty segments own no position."""
    from megatron_hybrid.padding.batch import segment_offsets

    want = [offset for n in lengths for offset in range(n)]
    got = segment_offsets(lengths)
    assert got.dtype == torch.long and got.tolist() == want


@pytest.mark.parametrize(
    "values, lengths, match",
    [([1, 2], [3], "2 values for 1 segments"), ([1, 2], [3, -1], "lengths must be >= 0")],
    ids=["sizes", "negative"],
)
def test_per_segment_errors(values, lengths, match):
    from megatron_hybrid.padding.batch import per_segment

    with pytest.raises(ValueError, match=match):
        per_segment(values, lengths)


@FAST
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    tail=st.integers(-3, 5),
)
def test_seq_idx_of_equals_megatron_s_own(lengths, tail):
    """megatron's __post_init__ from the same boundaries (its extra sequence for rows after the
    last boundary; lengths clamped where total_tokens is short of it)."""
    import itertools

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hybrid.padding.batch import seq_idx_of

    cu = list(itertools.accumulate(lengths, initial=0))
    total = max(0, cu[-1] + tail)
    want = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q_padded=torch.tensor(cu, dtype=torch.int32),
        total_tokens=total,
    ).seq_idx  # fmt: skip
    got = seq_idx_of(cu, total)
    assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want)
    if tail > 0:  # control: the rows after the last boundary are a sequence of their own
        assert got[0, -1].item() == len(cu) - 1


def test_packing_and_moving_run_no_repeat_interleave(monkeypatch):
    """pack_thd, its PackedSeqParams and their move build the positions, the padding mask and
    seq_idx without torch's repeat_interleave (its CPU kernel opens a parallel region per call),
    and the moved params keep the seq_idx they had."""
    from megatron_hybrid.padding.batch import packed_seq_params_to

    seqs = make_sequences([5, 3, 7], seed=0, positions=False)
    plan = thd_pack([5, 3, 7], mode="minimal", tp=1, cp=1, sp=False, chunk=4)
    monkeypatch.setattr(torch, "repeat_interleave", _refuse)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", _refuse)
    packed = pack_thd(seqs, plan, pad_token_id=3)
    moved = packed_seq_params_to(packed.packed_seq_params, torch.device("cpu"))
    monkeypatch.undo()
    assert torch.equal(moved.seq_idx, packed.packed_seq_params.seq_idx)
    assert moved.total_tokens == plan.total_tokens
    # Control: megatron's own construction with total_tokens does call it.
    from megatron.core.packed_seq_params import PackedSeqParams

    monkeypatch.setattr(torch, "repeat_interleave", _refuse)
    with pytest.raises(AssertionError, match="repeat_interleave called"):
        PackedSeqParams(qkv_format="thd", cu_seqlens_q=moved.cu_seqlens_q,
                        total_tokens=plan.total_tokens)  # fmt: skip


def _refuse(*args, **kwargs):
    raise AssertionError("repeat_interleave called")

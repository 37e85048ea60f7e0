"""``forward_logprobs`` on ``train``-built models: against plain forwards, layouts, bad input.

TP1 (in this process): every sequence's log-probs and entropies equal ``log_softmax`` of the
model's logits for that sequence alone, packed and padded, in one micro-batch or several, with the
vocabulary's padding rows left out. TP2, EP2, PP2 and PP2 x VPP2 (two gloo ranks, the TP1 model
loaded from its checkpoint): the same numbers on every rank; packed == separate (with a leaking
control) at TP2 and EP2 for patterns holding every symbol the local backend builds.
"""

from __future__ import annotations

import pytest
import torch
from support.layouts import LAYOUTS, PATTERNS, VOCAB, max_error, run_layouts
from support.layouts import layout_model as _model
from support.packing import PACKING_LENGTHS, random_sequences

from megatron_hybrid.testing.spawn import run_distributed

FLAGS = PATTERNS["attention"][1]
EXACT = 1e-5


def _reference(model, sequences, vocab=VOCAB):
    """Per sequence: log_softmax over the real vocabulary of the model's logits alone."""
    out = []
    with torch.no_grad():
        for s in sequences:
            logits = model(s.unsqueeze(0), torch.arange(len(s)).unsqueeze(0), None)[0]
            log_p = torch.log_softmax(logits[:, :vocab].double(), -1)[:-1]
            out.append((log_p.gather(-1, s[1:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)))
    return out


def _max_error(got, want) -> float:
    return max(
        (a.double() - b).abs().max().item() if a.numel() else 0.0
        for pair_got, pair_want in zip(got, want, strict=True)
        for a, b in zip(pair_got, pair_want, strict=True)
    )


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("max_tokens", [8192, 48], ids=["one-micro-batch", "several"])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_equals_log_softmax_of_each_sequence_alone(pg, name, max_tokens, packed):
    from megatron_hybrid.logprobs import forward_logprobs

    pattern, flags = PATTERNS[name]
    model = _model(pg, pattern, *flags)
    sequences = random_sequences(vocab_size=VOCAB)
    model.train()
    logprobs, entropies = forward_logprobs(model, sequences, max_tokens_per_micro_batch=max_tokens,
                                           with_entropy=True, vocab_size=VOCAB,
                                           packed=packed)  # fmt: skip
    got = list(zip(logprobs, entropies, strict=True))
    assert model.training and all(m.training for m in model.modules())  # mode restored
    assert [len(lp) for lp, _ in got] == [n - 1 for n in PACKING_LENGTHS]
    assert all(lp.dtype == h.dtype == torch.float32 for lp, h in got)
    model.eval()
    assert _max_error(got, _reference(model, sequences)) < EXACT
    # Negative control: the vocabulary padding rows counted in the softmax.
    counted = forward_logprobs(model, sequences, packed=packed)
    pairs = zip(counted[1:], got[1:], strict=True)
    assert max((a - b[0]).abs().max().item() for a, b in pairs) > 1e-3


def test_temperature_and_plain_results(pg):
    from megatron_hybrid.logprobs import forward_logprobs

    model = _model(pg, "[*E]", *FLAGS).eval()
    sequences = random_sequences((4, 9), vocab_size=VOCAB)
    got = forward_logprobs(model, sequences, temperature=0.5)
    assert all(torch.is_tensor(lp) for lp in got)
    with torch.no_grad():
        logits = model(sequences[1].unsqueeze(0), torch.arange(9).unsqueeze(0), None)[0]
    want = torch.log_softmax(logits.double() / 0.5, -1)[:-1].gather(-1, sequences[1][1:, None])
    torch.testing.assert_close(got[1].double(), want.squeeze(-1), rtol=0, atol=EXACT)


def test_with_entropy_gives_two_lists(pg):
    """Two sequences: per-sequence pairs would unpack into ``lp, ent`` too, wrongly."""
    from megatron_hybrid.logprobs import forward_logprobs

    model = _model(pg, "[*E]", *FLAGS).eval()
    sequences = random_sequences((4, 9), vocab_size=VOCAB)
    logprobs, entropies = forward_logprobs(model, sequences, with_entropy=True, vocab_size=VOCAB)
    assert [len(lp) for lp in logprobs] == [len(h) for h in entropies] == [3, 8]
    plain = forward_logprobs(model, sequences, vocab_size=VOCAB)
    assert all(torch.equal(a, b) for a, b in zip(logprobs, plain, strict=True))
    assert all(bool((h > 0).all()) for h in entropies)


@pytest.mark.parametrize(
    "sequences, kwargs, match",
    [
        ([], {}, "sequences is empty"),
        ([torch.tensor([3, 4]), torch.tensor([], dtype=torch.long)], {}, "sequence 1 is empty"),
        ([torch.tensor([3, 128, 4])], {}, r"token id 128 at position 1, outside .*\[0, 128\)"),
        ([torch.tensor([3, 125])], dict(vocab_size=120), r"token id 125 .*\[0, 120\)"),
        ([torch.tensor([[3, 4]])], {}, "sequence 0 must be a 1-D integer tensor"),
        ([torch.tensor([0.5, 1.0])], {}, "must be a 1-D integer tensor"),
        (torch.tensor([3, 4]), {}, "must be a list of 1-D token tensors"),
        ([torch.arange(1, 40)], dict(max_tokens_per_micro_batch=32), r"sequence 0 has 39 tokens"),
        ([torch.tensor([3, 4])], dict(max_tokens_per_micro_batch=0), "must be >= 1"),
        ([torch.tensor([3, 4])], dict(temperature=0), "positive finite"),
    ],
    ids=["empty-list", "empty-sequence", "id-too-large", "id-past-vocab-size", "2-d", "float"]
    + ["not-a-list", "longer-than-micro-batch", "no-tokens-per-micro-batch", "temperature"],
)
def test_bad_input_gets_one_clear_error(pg, sequences, kwargs, match):
    from megatron_hybrid.logprobs import forward_logprobs

    model = _model(pg, "[*E]", *FLAGS)
    with pytest.raises(ValueError, match=match):
        forward_logprobs(model, sequences, **kwargs)


def test_packed_refused_where_a_layer_cannot_pack(pg):
    from megatron_hybrid.logprobs import forward_logprobs

    model = _model(pg, "[GE]", *FLAGS, deterministic_mode=True)
    with pytest.raises(ValueError, match=r"packed=True, but .*deterministic mode"):
        forward_logprobs(model, [torch.tensor([3, 4, 5])], packed=True)
    # Left to choose, it pads rows instead.
    assert forward_logprobs(model, [torch.tensor([3, 4, 5])])[0].shape == (2,)


def _layouts_worker(rank, world_size, checkpoint, sequences):
    """Per layout: forward_logprobs of the checkpoint's model; at TP2/EP2 also packing errors
    (the comparison the GPU suite runs on NCCL: ``support.layouts``)."""
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    torch.set_num_threads(1)
    return run_layouts(rank, world_size, checkpoint, sequences)


@pytest.mark.distributed
@pytest.mark.slow
def test_layouts_give_tp1_results_and_pack_exactly(pg, tmp_path):
    from megatron.core import dist_checkpointing

    from megatron_hybrid.checkpointing.sharded import model_sharded_state
    from megatron_hybrid.logprobs import forward_logprobs

    pattern, flags = PATTERNS["attention"]
    model = _model(pg, pattern, *flags).eval()
    sequences = random_sequences(vocab_size=VOCAB, seed=5)
    lp, h = forward_logprobs(model, sequences, with_entropy=True, vocab_size=VOCAB)
    reference = [[a.tolist(), b.tolist()] for a, b in zip(lp, h, strict=True)]
    dist_checkpointing.save(model_sharded_state([model]), str(tmp_path))
    per_rank = run_distributed(_layouts_worker, 2, str(tmp_path), sequences, timeout=900)
    for rank, results in enumerate(per_rank):
        assert set(results) == set(LAYOUTS)
        for name, result in results.items():
            where = f"{name} rank {rank}"
            assert max_error(result["logprobs"], reference) < EXACT, where
            if "leaking logprobs" in result:  # control: the state runs across sequences
                assert max_error(result["leaking logprobs"], reference) > 1e-3, where
            errors = result.get("errors")
            if errors:
                assert max(errors["attention"] + errors["mla"]) < EXACT, (where, errors)
                assert max(errors["leaking"][1:]) > 1e-3, (where, errors)

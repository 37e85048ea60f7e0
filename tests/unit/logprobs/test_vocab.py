"""``token_logprobs`` / ``token_entropy`` against ``log_softmax`` over the gathered vocabulary.

The reference is plain torch on the whole ``[..., V]`` logits (float64); the functions see only
a vocabulary shard per rank. Padded vocabulary columns carry large logits, so a version that left
them in the softmax is far off (the negative control shows it).
"""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.logprobs import token_entropy, token_logprobs
from megatron_hybrid.logprobs.vocab import token_logprobs_and_entropy
from megatron_hybrid.testing.spawn import run_distributed

VOCAB, PADDED = 250, 256  # the model's vocabulary and its TP-padded size


def _inputs(seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(3, 7, PADDED, generator=gen)
    logits[..., VOCAB:] = 20.0  # padding columns that would dominate the softmax if counted
    labels = torch.randint(0, VOCAB, (3, 7), generator=gen)
    return logits.to(dtype), labels


def _reference(logits, labels, temperature=1.0):
    log_p = torch.log_softmax(logits[..., :VOCAB].double() / temperature, -1)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["t1", "t0.7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_match_log_softmax_without_padding_columns(dtype, temperature):
    logits, labels = _inputs(dtype=dtype)
    want_lp, want_h = _reference(logits, labels, temperature)
    lp = token_logprobs(logits, labels, temperature=temperature, vocab_size=VOCAB)
    h = token_entropy(logits, temperature=temperature, vocab_size=VOCAB)
    assert lp.dtype == h.dtype == torch.float32 and lp.shape == labels.shape
    torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=2e-5)
    torch.testing.assert_close(h.double(), want_h, rtol=0, atol=2e-5)
    # Negative control: the padding columns left in the softmax.
    assert (token_logprobs(logits, labels, temperature=temperature) - lp).abs().max() > 1.0


def test_gradients_match_autograd_of_log_softmax():
    logits, labels = _inputs(seed=1)
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))
    leaf = logits.clone().requires_grad_()
    (
        (token_logprobs(leaf, labels, vocab_size=VOCAB, temperature=0.8) * weights).sum()
        + (token_entropy(leaf, vocab_size=VOCAB, temperature=0.8) * weights).sum()
    ).backward()
    ref_leaf = logits.double().clone().requires_grad_()
    lp, h = _reference(ref_leaf, labels, 0.8)
    ((lp * weights).sum() + (h * weights).sum()).backward()
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=0, atol=1e-5)
    assert leaf.grad[..., VOCAB:].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_at_once_equal_each_alone(dtype):
    logits, labels = _inputs(seed=5, dtype=dtype)
    lp, h = token_logprobs_and_entropy(logits, labels, vocab_size=VOCAB, temperature=0.7)
    assert torch.equal(lp, token_logprobs(logits, labels, vocab_size=VOCAB, temperature=0.7))
    assert torch.equal(h, token_entropy(logits, vocab_size=VOCAB, temperature=0.7))


@pytest.mark.parametrize("block", [None, 2 * PADDED + 5], ids=["whole", "two-rows-a-block"])
@pytest.mark.parametrize("which", ["logprobs", "entropy", "both"])
def test_both_at_once_backward_matches_autograd(monkeypatch, which, block):
    import megatron_hybrid.logprobs.vocab as vocab

    if block is not None:
        monkeypatch.setattr(vocab, "BLOCK_ELEMENTS", block)
    logits, labels = _inputs(seed=6)
    gen = torch.Generator().manual_seed(7)
    w_lp, w_h = torch.randn(labels.shape, generator=gen), torch.randn(labels.shape, generator=gen)
    use_lp, use_h = which in ("logprobs", "both"), which in ("entropy", "both")

    def loss(lp, h):  # only the outputs asked for take part
        return sum(
            (value * weight).sum()
            for value, weight, used in ((lp, w_lp, use_lp), (h, w_h, use_h))
            if used
        )

    leaf = logits.clone().requires_grad_()
    loss(*token_logprobs_and_entropy(leaf, labels, vocab_size=VOCAB, temperature=0.8)).backward()
    ref_leaf = logits.double().clone().requires_grad_()
    loss(*_reference(ref_leaf, labels, 0.8)).backward()
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=0, atol=1e-5)
    assert leaf.grad[..., VOCAB:].abs().max() == 0


def test_work_in_blocks_gives_the_same_result(monkeypatch):
    import megatron_hybrid.logprobs.vocab as vocab

    logits, labels = _inputs(seed=3)
    whole = token_logprobs(logits, labels, vocab_size=VOCAB), token_entropy(logits)
    monkeypatch.setattr(vocab, "BLOCK_ELEMENTS", 2 * PADDED + 5)  # two rows per block
    blocked = token_logprobs(logits, labels, vocab_size=VOCAB), token_entropy(logits)
    for a, b in zip(whole, blocked, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, y: token_logprobs(x, y[:, :3]), r"labels \(3, 3\) must have the logits' shape"),
        (lambda x, y: token_logprobs(x, y.float()), "labels must be an integer tensor"),
        (lambda x, y: token_logprobs(x, y + VOCAB, vocab_size=VOCAB), r"token ids in \[0, 250\)"),
        (lambda x, y: token_logprobs(x, y - 1000), r"got values in \[-"),
        (lambda x, y: token_logprobs(x, y, temperature=0.0), "positive finite number"),
        (lambda x, y: token_entropy(x, temperature=-1.0), "positive finite number"),
        (lambda x, y: token_entropy(x, vocab_size=PADDED + 1), "exceeds the 256 logits"),
        (lambda x, y: token_entropy(x.long()), "floating-point tensor"),
    ],
    ids=["label-shape", "label-dtype", "label-id", "negative-id", "temperature-0"]
    + ["temperature-negative", "vocab-size", "logits-dtype"],
)
def test_bad_input_is_refused(call, match):
    logits, labels = _inputs()
    with pytest.raises(ValueError, match=match):
        call(logits, labels)


def _tp2_worker(rank: int, world_size: int, logits, labels):
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    shard = logits.chunk(2, dim=-1)[rank].clone().requires_grad_()
    lp = token_logprobs(shard, labels, tp_group=group, vocab_size=VOCAB, temperature=0.9)
    h = token_entropy(shard, tp_group=group, vocab_size=VOCAB, temperature=0.9)
    (lp.sum() + h.sum()).backward()
    both = shard.detach().clone().requires_grad_()
    lp2, h2 = token_logprobs_and_entropy(
        both, labels, tp_group=group, vocab_size=VOCAB, temperature=0.9
    )
    (lp2.sum() + h2.sum()).backward()
    assert torch.equal(lp2, lp) and torch.equal(h2, h)
    torch.testing.assert_close(both.grad, shard.grad, rtol=0, atol=1e-6)
    # numpy: tensors would travel through shared memory that the rank releases when it exits.
    return lp.detach().numpy(), h.detach().numpy(), shard.grad.numpy()


@pytest.mark.distributed
def test_tp2_equals_tp1_with_padding_columns_on_the_last_rank():
    """Rank 1 holds ids 128..255, the last six of them padding."""
    logits, labels = _inputs(seed=4)
    leaf = logits.clone().requires_grad_()
    lp = token_logprobs(leaf, labels, vocab_size=VOCAB, temperature=0.9)
    h = token_entropy(leaf, vocab_size=VOCAB, temperature=0.9)
    (lp.sum() + h.sum()).backward()
    for rank, result in enumerate(run_distributed(_tp2_worker, 2, logits, labels)):
        lp2, h2, grad = (torch.from_numpy(x) for x in result)
        torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(h2, h, rtol=0, atol=1e-5)
        torch.testing.assert_close(grad, leaf.grad.chunk(2, dim=-1)[rank], rtol=0, atol=5e-6)

"""The Triton softmax-statistics and gradient kernels (``kernels/vocab_rows.py``) under Triton's
CPU interpreter, through the public ``token_logprobs`` / ``token_entropy`` / their pair, values
and gradients (the gradients within ``tests/support/cross_entropy.py``'s
``exact_logprob_gradient`` bound of float64 autograd).

CUDA takes the kernel wherever Triton imports; on a CPU the torch blocks run, so these tests
start gloo ranks with ``TRITON_INTERPRET=1`` (which routes host tensors to the kernel) and count
its launches, so that a test cannot pass on the torch path. The reference is ``log_softmax`` in
float64 over the gathered vocabulary.

Bounds. Both sides accumulate ``S = sum exp(z)`` (terms in ``(0, 1]``, all positive) and ``U =
sum exp(z) z`` (terms all of one sign) in float32; for ``n`` such terms the relative error of a
float32 sum is at most ``(n - 1) u`` (``u = 2^-24``), each ``exp`` adds a few ``u``, and each of
the kernel's rescalings one more (at most one per loop iteration). With ``n`` = the row's columns
that bound on ``log S`` is ``(n + k) u`` for a small ``k``; we take ``2 (n + 16) u`` for the
difference of two float32 computations. Rows mix random logits with rows that grow along the
vocabulary, so that every block raises every lane's maximum and the rescaling runs each time.

Negative controls: an off-by-one vocabulary size (the last real column left out, where it is the
row's largest) and TP shards combined without the all-reduce both exceed the bound by far.
"""

from __future__ import annotations

import pytest
import torch
from support.cross_entropy import exact_logprob_gradient

from megatron_hybrid.testing.spawn import run_distributed

VOCAB, PADDED = 9000, 9216  # over two of the kernel's 4,096-column blocks; padding columns
U = 2.0**-24
BOUND = 2 * (VOCAB + 16) * U
#: Per-row gradients of the log-probs and the entropies (nonnegative and signed).
WEIGHTS = (torch.linspace(0.5, 1.5, 6), torch.linspace(-1.0, 1.0, 6))


def _inputs(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(6, PADDED, generator=gen)
    # Two rows that grow along the vocabulary: the maximum moves in every block, gently (the
    # running sums keep weight, so a wrong rescale shows) and steeply.
    logits[4] = torch.linspace(-1, 2, PADDED)
    logits[5] = torch.linspace(-5, 40, PADDED) + torch.randn(PADDED, generator=gen)
    logits[:, VOCAB:] = 60.0  # padding that would dominate the softmax if counted
    labels = torch.randint(0, VOCAB, (6,), generator=gen)
    labels[5] = VOCAB - 1
    return logits.to(dtype), labels


def _reference(logits, labels, temperature):
    log_p = torch.log_softmax(logits[:, :VOCAB].double() / temperature, -1)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _reference_gradient(logits, labels, temperature, world: int, entropy: bool):
    rounding = 2.0**-7 if logits.dtype == torch.bfloat16 else 2.0**-24  # bf16 truncated
    return exact_logprob_gradient(logits, labels, temperature, VOCAB, world, WEIGHTS[0],
                                  WEIGHTS[1] if entropy else None, rounding)  # fmt: skip


def _launches() -> list[str]:
    import triton.runtime.interpreter as interpreter

    seen = []
    call = interpreter.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        seen.append(self.fn.__name__)
        return call(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = launch
    return seen


def _rank(rank: int, world: int, dtype_name: str, temperature: float) -> dict:
    import torch.distributed as dist

    from megatron_hybrid.kernels.vocab_rows import combine_shards, row_statistics
    from megatron_hybrid.logprobs import token_entropy, token_logprobs
    from megatron_hybrid.logprobs.vocab import token_logprobs_and_entropy

    launches = _launches()
    logits, labels = _inputs(getattr(torch, dtype_name))
    group = dist.group.WORLD if world > 1 else None
    shard = logits.chunk(world, -1)[rank].contiguous()
    kw = dict(tp_group=group, temperature=temperature, vocab_size=VOCAB)
    lp = token_logprobs(shard, labels, **kw)
    h = token_entropy(shard, **kw)
    pair = token_logprobs_and_entropy(shard, labels, **kw)
    # Gradients (the second Triton pass): of both outputs at once, and of the log-probs alone.
    leaf = shard.clone().requires_grad_()
    both = token_logprobs_and_entropy(leaf, labels, **kw)
    ((both[0] * WEIGHTS[0]).sum() + (both[1] * WEIGHTS[1]).sum()).backward()
    alone = shard.clone().requires_grad_()
    token_logprobs(alone, labels, **kw).backward(WEIGHTS[0])
    out = dict(lp=lp, h=h, pair_lp=pair[0], pair_h=pair[1], grad=leaf.grad,
               grad_lp=alone.grad, launches=list(launches))  # fmt: skip
    # Negative control 1: the vocabulary one column short (the last real one is row 5's largest).
    out["short_lp"] = token_logprobs(shard, labels.clamp(max=VOCAB - 2), tp_group=group,
                                     temperature=temperature, vocab_size=VOCAB - 1)  # fmt: skip
    if world > 1:
        # Negative control 2: each rank's shard statistics, not combined over the group.
        valid = max(0, min(shard.size(1), VOCAB - rank * shard.size(1)))
        alone = combine_shards(*row_statistics(shard, valid, temperature, True), None)
        out["local_log_sum"] = alone.total.log()
    # Plain lists: tensors would travel as shared memory of a process that has ended.
    return {k: v.tolist() if torch.is_tensor(v) else v for k, v in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fp32", "bf16"])
def test_kernel_matches_float64_log_softmax(world, dtype):
    pytest.importorskip("triton.runtime.interpreter")
    temperature = 0.7
    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    results = run_distributed(_rank, world, dtype, temperature, env=env)
    logits, labels = _inputs(getattr(torch, dtype))
    want_lp, want_h = _reference(logits, labels, temperature)
    # Entropy: |H| <= log V and its error is that of log S plus U / S's (relative to |U / S|).
    h_bound = BOUND * (1 + 2 * torch.log(torch.tensor(float(VOCAB))).item())
    want_grad, grad_bound = _reference_gradient(logits, labels, temperature, world, True)
    want_grad_lp, grad_lp_bound = _reference_gradient(logits, labels, temperature, world, False)
    for rank, got in enumerate(results):
        assert got["launches"].count("row_statistics_kernel") == 5, got["launches"]
        assert got["launches"].count("softmax_gradient_kernel") == 2, got["launches"]
        columns = slice(rank * PADDED // world, (rank + 1) * PADDED // world)
        for key, want, bound in (("grad", want_grad, grad_bound),
                                 ("grad_lp", want_grad_lp, grad_lp_bound)):  # fmt: skip
            error = (torch.tensor(got[key]).double() - want[:, columns]).abs()
            assert (error <= bound[:, columns]).all(), (key, (error / bound[:, columns]).max())
        for lp_key, h_key in (("lp", "h"), ("pair_lp", "pair_h")):
            lp_error = (torch.tensor(got[lp_key]).double() - want_lp).abs().max().item()
            h_error = (torch.tensor(got[h_key]).double() - want_h).abs().max().item()
            assert lp_error <= BOUND, (rank, lp_key, lp_error, BOUND)
            assert h_error <= h_bound, (rank, h_key, h_error, h_bound)
        short = (torch.tensor(got["short_lp"]).double() - want_lp)[4:].abs().max().item()
        assert short > 100 * BOUND, short
        if world > 1:
            want_log_sum = torch.logsumexp(logits[:, :VOCAB].double() / temperature, -1)
            want_log_sum -= (logits[:, :VOCAB].double() / temperature).amax(-1)
            local = (torch.tensor(got["local_log_sum"]).double() - want_log_sum).abs().max().item()
            assert local > 100 * BOUND, local

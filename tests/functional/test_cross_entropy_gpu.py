"""megatron's fused cross entropy as two Triton passes (``kernels/cross_entropy.py``) on a GPU, at
the shape of issue 33's benchmark (4,096 tokens, vocabulary 32,768), against float64 and against
megatron-core's compiled fused cross entropy (what ``cross_entropy_fusion_impl="native"`` runs
without the package), with both timed; at a Qwen-sized vocabulary over 2^31 logits, where
every offset past int32 must hold; and the same gradient kernel under the log-probs' backward
(``token_logprobs_and_entropy``) against float64 and the torch blocks it replaces.

    torchrun --nproc_per_node 1 -m pytest -q -s tests/functional/test_cross_entropy_gpu.py

The bounds are ``tests/support/cross_entropy.py``'s (float32 error analysis of the kernels' order
of operations) with compiled Triton's rounding to nearest; megatron's compiled version is held to
the generic bound of ``n`` float32 additions, and for float32 and float16 logits only to
megatron's own bf16 gradient (its fused backward returns bf16 whatever the logits are). The
control is the gradient of the next column's target. Every rank runs the same single-GPU
computation, so the test passes on 1, 2 or 4 GPUs alike.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gpu_time_us, report
from support.cross_entropy import NEAREST, exact_cross_entropy, exact_logprob_gradient

ROWS, VOCAB = 4096, 32768


@pytest.fixture
def pg(world):
    from megatron_hybrid.process_groups import initialize_model_parallel, reset_megatron_state

    yield initialize_model_parallel(seed=1)
    reset_megatron_state()


def _inputs(rows: int, vocab: int, dtype, device, seed: int = 7):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = 3 * torch.randn(rows, 1, vocab, generator=gen, device=device, dtype=dtype)
    logits[5, 0] = torch.linspace(-5, 40, vocab, device=device, dtype=dtype)
    target = torch.randint(0, vocab, (rows, 1), generator=gen, device=device)
    target[0], target[1], target[2] = 0, vocab - 1, -100
    target[-1] = vocab - 1  # the last logit of all
    grad = torch.rand(rows, 1, generator=gen, device=device) + 0.5
    return logits, target, grad


def _grads(fn, logits, target, grad, group):
    leaf = logits.detach().requires_grad_()
    loss = fn(leaf, target, group)
    (got,) = torch.autograd.grad(loss, leaf, grad)
    return loss.detach()[:, 0].double(), got[:, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])  # fmt: skip
def test_cross_entropy_kernels_against_float64_and_megatron(world, pg, dtype):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    from megatron_hybrid.kernels.cross_entropy import (
        cross_entropy_reason,
        vocab_parallel_cross_entropy,
    )

    _, _, device = world
    if device.type != "cuda":
        pytest.skip("compiled Triton and megatron's compiled fusion need CUDA")
    group = pg.tp  # of one rank: the whole vocabulary here
    logits, target, grad = _inputs(ROWS, VOCAB, dtype, device)
    assert cross_entropy_reason(logits) is None, cross_entropy_reason(logits)
    flat, flat_target = logits[:, 0], target[:, 0]
    loss, exact, (loss_bound, grad_bound), (generic_loss, generic_grad) = exact_cross_entropy(
        flat, flat_target, grad, 1, NEAREST[dtype]
    )
    if dtype != torch.bfloat16:  # megatron's fused backward rounds to bf16 whatever the dtype
        generic_grad = generic_grad + NEAREST[torch.bfloat16] * exact.abs()

    rows_out = [("path", "max loss error / bound", "max gradient error / bound", "µs")]
    paths = (("Triton", vocab_parallel_cross_entropy, loss_bound, grad_bound),
             ("megatron compiled", fused_vocab_parallel_cross_entropy, generic_loss,
              generic_grad))  # fmt: skip
    for name, fn, bound_loss, bound_grad in paths:
        got_loss, got = _grads(fn, logits, target, grad, group)
        loss_ratio = ((got_loss - loss).abs() / bound_loss).max().item()
        grad_ratio = ((got.double() - exact).abs() / bound_grad).max().item()
        assert got.dtype == dtype, got.dtype  # autograd casts megatron's bf16 to the logits'
        del got
        micros = gpu_time_us(lambda fn=fn: _grads(fn, logits, target, grad, group), 10)
        rows_out.append((name, f"{loss_ratio:.3f}", f"{grad_ratio:.3f}", f"{micros:.0f}"))
        assert loss_ratio <= 1 and grad_ratio <= 1, (name, loss_ratio, grad_ratio)
    report(f"cross entropy, {ROWS} x {VOCAB} {dtype}, forward + backward", rows_out)
    _, shifted = _grads(vocab_parallel_cross_entropy, logits, (target + 1) % VOCAB, grad, group)
    assert ((shifted.double() - exact).abs() > 1000 * grad_bound).any()


def test_cross_entropy_past_int32_offsets(world, pg):
    """16,384 x 151,936 bf16 logits (2.5e9 > 2^31): the last rows, whose offsets need int64,
    against float64; the control takes the last row's target one column earlier."""
    from megatron_hybrid.kernels.cross_entropy import vocab_parallel_cross_entropy

    _, _, device = world
    if device.type != "cuda":
        pytest.skip("compiled Triton needs CUDA")
    rows, vocab = 16384, 151936
    free, _ = torch.cuda.mem_get_info(device)
    if free < 16 * 2**30:
        pytest.skip(f"needs 16 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    assert rows * vocab > 2**31
    logits, target, grad = _inputs(rows, vocab, torch.bfloat16, device, seed=3)
    got_loss, got = _grads(vocab_parallel_cross_entropy, logits, target, grad, None)
    tail = slice(rows - 4, rows)
    loss, exact, (loss_bound, grad_bound), _ = exact_cross_entropy(
        logits[tail, 0], target[tail, 0], grad[tail], 1, NEAREST[torch.bfloat16]
    )
    loss_ratio = ((got_loss[tail] - loss).abs() / loss_bound).max().item()
    grad_ratio = ((got[tail].double() - exact).abs() / grad_bound).max().item()
    report(f"cross entropy, {rows} x {vocab} bf16, the last 4 rows",
           [("max loss error / bound", f"{loss_ratio:.3f}"),
            ("max gradient error / bound", f"{grad_ratio:.3f}")])  # fmt: skip
    assert loss_ratio <= 1 and grad_ratio <= 1, (loss_ratio, grad_ratio)
    del got
    target[-1] -= 1
    _, wrong = _grads(vocab_parallel_cross_entropy, logits, target, grad, None)
    assert ((wrong[tail].double() - exact).abs() > 1000 * grad_bound).any()


def test_logprob_gradient_in_one_pass(world, monkeypatch):
    """The log-probs' and entropies' gradient of a Qwen3.5-sized vocabulary (248,320 of 248,576
    columns, T = 0.9) through the Triton pass and through the torch blocks, each within
    ``exact_logprob_gradient``'s bound of float64; the control leaves the padding columns in
    the softmax."""
    from megatron_hybrid.logprobs import vocab
    from megatron_hybrid.logprobs.vocab import token_logprobs_and_entropy

    _, _, device = world
    if device.type != "cuda":
        pytest.skip("times CUDA kernels (the CPU runs the torch blocks only)")
    vocab_size, padded, rows, temperature = 248_320, 248_576, 512, 0.9
    gen = torch.Generator().manual_seed(5)
    logits = (4 * torch.randn(rows, padded, generator=gen)).to(device, torch.bfloat16)
    logits[:, vocab_size:] = 30.0
    labels = torch.randint(0, vocab_size, (rows,), generator=gen).to(device)
    g_lp = (torch.rand(rows, generator=gen) + 0.5).to(device)
    g_h = (torch.rand(rows, generator=gen) - 0.5).to(device)
    want, bound = exact_logprob_gradient(logits, labels, temperature, vocab_size, 1, g_lp, g_h,
                                         NEAREST[torch.bfloat16])  # fmt: skip

    def run(size: int = vocab_size):
        leaf = logits.detach().requires_grad_()
        lp, h = token_logprobs_and_entropy(leaf, labels, temperature=temperature,
                                           vocab_size=size, check_labels=False)  # fmt: skip
        return torch.autograd.grad([lp, h], leaf, [g_lp, g_h])[0]

    kernel = ((run().double() - want).abs() / bound).max().item()
    kernel_us = gpu_time_us(run, 10)
    monkeypatch.setattr(vocab, "kernel_reason", lambda flat: "the torch blocks, for comparison")
    blocks = ((run().double() - want).abs() / bound).max().item()
    blocks_us = gpu_time_us(run, calls=3)
    monkeypatch.undo()
    report(f"log-prob and entropy gradients, {rows} x {vocab_size} bf16, T = {temperature}",
           [("path", "max error / bound", "forward + backward µs"),
            ("Triton", f"{kernel:.3f}", f"{kernel_us:.0f}"),
            ("torch blocks", f"{blocks:.3f}", f"{blocks_us:.0f}")])  # fmt: skip
    assert kernel <= 1, kernel
    wrong = run(padded)  # padding counted in the softmax
    assert ((wrong.double() - want).abs() > 1000 * bound).any()

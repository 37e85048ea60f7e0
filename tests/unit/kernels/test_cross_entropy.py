"""megatron's fused cross entropy as two Triton passes (``kernels/cross_entropy.py``) under
Triton's CPU interpreter, on one and two gloo ranks (the vocabulary split over TP), against the
loss and gradient computed in float64, against megatron-core's own (unfused) vocab-parallel
cross entropy, and inside ``HybridModel``'s loss.

CUDA takes the kernels wherever Triton imports; on a CPU ``TRITON_INTERPRET=1`` routes host
tensors to them, and the ranks count the launches, so that no comparison can pass on a torch path.

Bounds, from float32 error analysis (``u = 2^-24``), per row of ``n`` columns:

* loss ``= log S - (x_t - m)``: ``S`` sums ``n`` terms in ``(0, 1]`` (relative error at most
  ``(n - 1) u`` plus a few ``u`` per ``exp`` and per rescaling of the running sum, as in
  ``tests/unit/logprobs/test_vocab_kernel.py``: ``2 (n + 16) u`` for ``log S``); the two additions
  and the logarithm add ``u`` of their operands each: ``4 u (|m| + |log S| + |x_t|)``.
* gradient ``(exp(x - m) / S - [j = t]) g``: the softmax carries ``S``'s error, ``u |x - m|`` from
  the subtraction and a few ``u`` from the exponential and division; then one rounding to the
  logits' dtype (half a unit in the last place, ``2^-24`` of the value in float32; a whole one,
  ``2^-7``, in bf16, which the interpreter truncates to).

Rows mix random logits, rows that grow along the vocabulary (every block of the statistics pass
raises its running maximum) and targets at the first and last column, in another rank's shard
and outside the vocabulary (an ignored ``-100``: megatron's loss is then ``log S`` and no column
loses one). Negative controls: a target one column off, and TP shards whose
statistics are not combined, each exceed the bounds by far.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROWS, VOCAB = 7, 9216
MODEL_VOCAB = 256  # two ranks' shards of 4,608 columns: over one 4,096-column block each
U = 2.0**-24
# The result's rounding to the logits' dtype. Triton's interpreter truncates float32 to bf16
# (a whole unit in the last place; compiled Triton rounds to nearest, half a unit, which
# tests/functional/test_cross_entropy_gpu.py holds it to).
ROUNDING = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-7}


def _inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(11)
    logits = 4 * torch.randn(ROWS, VOCAB, generator=gen)
    logits[4] = torch.linspace(-1, 2, VOCAB)
    logits[5] = torch.linspace(-5, 40, VOCAB) + torch.randn(VOCAB, generator=gen)
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    target[0], target[5], target[6] = 0, VOCAB - 1, -100
    grad = torch.rand(ROWS, generator=gen) + 0.5
    return logits.to(dtype), target, grad


def _exact(logits: torch.Tensor, target: torch.Tensor, grad: torch.Tensor):
    """Loss, gradient and each's bound, in float64."""
    x = logits.double()
    m = x.amax(-1, keepdim=True)
    log_sum = (x - m).exp().sum(-1, keepdim=True).log()
    inside = (target >= 0) & (target < VOCAB)
    # x[t] - m; 0 (megatron's value: the loss is log S) for a target outside the vocabulary.
    picked = x.gather(-1, target.clamp(0, VOCAB - 1)[:, None])[:, 0] - m[:, 0]
    picked = torch.where(inside, picked, 0.0)
    loss = log_sum[:, 0] - picked
    softmax = (x - m - log_sum).exp()
    onehot = torch.zeros_like(x)
    onehot[inside] = torch.nn.functional.one_hot(target[inside], VOCAB).double()
    gradient = (softmax - onehot) * grad.double()[:, None]
    n = VOCAB
    loss_bound = 2 * (n + 16) * U + 4 * U * (
        m[:, 0].abs() + log_sum[:, 0].abs() + (picked + m[:, 0]).abs()
    )
    # The softmax's relative error times the scale; the float32 subtraction and product and
    # the rounding to the logits' dtype, relative to the result.
    relative = 2 * (n + 16) * U + U * (x - m).abs() + 8 * U
    grad_bound = softmax * grad.double()[:, None] * relative
    grad_bound += (2 * U + ROUNDING[logits.dtype]) * gradient.abs() + 1e-45
    return loss, gradient, loss_bound, grad_bound


def _rank(rank: int, world: int, dtype_name: str) -> dict:
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from support.triton_interpreter import counting_ranges

    from megatron_hybrid.kernels.cross_entropy import vocab_parallel_cross_entropy
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    launches: list[str] = []
    counting_ranges(launches.append)
    dtype = getattr(torch, dtype_name)
    logits, target, grad = _inputs(dtype)
    group = dist.new_group(list(range(world)))
    shard = logits.chunk(world, -1)[rank].contiguous()

    def run(fn, *args, **kwargs):
        leaf = shard.clone().requires_grad_()
        loss = fn(leaf, *args, **kwargs)
        loss.backward(grad)
        return loss.detach(), leaf.grad

    out = {}
    out["loss"], out["grad"] = run(vocab_parallel_cross_entropy, target, group)
    out["launches"] = list(launches)
    out["megatron_loss"], out["megatron_grad"] = run(
        tensor_parallel.vocab_parallel_cross_entropy, target, tp_group=group
    )
    # Negative controls: the target one column to the right; every rank on its own shard.
    out["shifted_grad"] = run(vocab_parallel_cross_entropy, (target + 1) % VOCAB, group)[1]
    if world > 1:
        out["alone_loss"] = run(vocab_parallel_cross_entropy, target, None)[0]
    # Plain lists: tensors would travel as shared memory of a process that has ended.
    return {k: v.float().tolist() if torch.is_tensor(v) else v for k, v in out.items()}


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def world(request):
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fp32", "bf16"])
def test_kernels_match_float64_and_megatron(world, dtype):
    pytest.importorskip("triton.runtime.interpreter")
    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    results = run_distributed(_rank, world, dtype, env=env)
    logits, target, grad = _inputs(getattr(torch, dtype))
    loss, gradient, loss_bound, grad_bound = _exact(logits, target, grad)
    for rank, got in enumerate(results):
        assert got["launches"].count("row_statistics_kernel") == 1, got["launches"]
        assert got["launches"].count("cross_entropy_backward_kernel") == 1, got["launches"]
        columns = slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
        mine, bound = gradient[:, columns], grad_bound[:, columns]
        loss_error = (torch.tensor(got["loss"]).double() - loss).abs()
        assert (loss_error <= loss_bound).all(), (loss_error / loss_bound).max()
        grad_error = (torch.tensor(got["grad"]).double() - mine).abs()
        assert (grad_error <= bound).all(), (grad_error / bound).max()
        # megatron's float32 steps are within the same bounds of float64, so within twice ours.
        agree = (torch.tensor(got["megatron_loss"]).double() - torch.tensor(got["loss"])).abs()
        assert (agree <= 2 * loss_bound).all(), (agree / loss_bound).max()
        agree = (torch.tensor(got["megatron_grad"]).double() - torch.tensor(got["grad"])).abs()
        assert (agree <= 2 * bound).all(), (agree / bound).max()
        shifted = (torch.tensor(got["shifted_grad"]).double() - mine).abs()
        assert (shifted > 1000 * bound).any()
        if world > 1:
            alone = (torch.tensor(got["alone_loss"]).double() - loss).abs()
            assert (alone > 1000 * loss_bound).any()


def _model_rank(rank: int, world: int) -> dict:
    """``HybridModel``'s loss (its MTP depth's too) and every gradient, with megatron's fused
    cross entropy asked for (the Triton passes run), with it off (megatron's unfused one), and
    the control: the Triton passes on labels one position off."""
    from support.triton_interpreter import counting_ranges

    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation
    from megatron_hybrid.testing.models import build_hybrid, model_inputs, small_config

    enable_cpu_emulation()
    launches: list[str] = []
    counting_ranges(launches.append)
    pattern = "[*-]/*-"
    pg = initialize_model_parallel(tp=world, seed=3)
    config = small_config(pattern, tensor_model_parallel_size=world)
    config.cross_entropy_fusion_impl = "native"
    model = build_hybrid(config, pattern, pg, vocab_size=MODEL_VOCAB)
    batch = model_inputs(batch=2, seq=8, vocab=MODEL_VOCAB, seed=5)
    out = {}
    for name, fused, labels in (
        ("triton", True, batch["labels"]),
        ("megatron", False, batch["labels"]),
        ("control", True, batch["labels"].roll(1, -1)),
    ):
        config.cross_entropy_loss_fusion = fused
        model.zero_grad(set_to_none=True)
        loss = model(batch["input_ids"], batch["position_ids"], None, labels=labels)
        loss.sum().backward()
        out[name] = dict(
            path=model.cross_entropy_path,
            loss=loss.detach(),
            grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
        out[name]["launches"], launches[:] = list(launches), []
    reference = out["megatron"]
    errors = {}
    for name in ("triton", "control"):
        got = out[name]
        error = {"loss": _relative(got["loss"], reference["loss"])}
        error.update({k: _relative(g, reference["grads"][k]) for k, g in got["grads"].items()})
        errors[name] = dict(error=error, path=got["path"], launches=got["launches"])
    errors["megatron"] = dict(path=reference["path"], launches=reference["launches"])
    return errors


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def test_hybrid_model_loss_runs_the_kernels_as_megatron_runs_its_own():
    """Every gradient of a TP2 model with an MTP depth (whose loss goes through the same method)
    is megatron's unfused cross entropy's, to float32 rounding; the control (labels one
    position off) is not.

    The two cross entropies differ by the float32 error of the softmax (``2 (n + 16) u`` and a
    few ``u`` relative to each logit's gradient, ``n`` the vocabulary shard); the layers below
    carry it through sums of nonnegative-weighted terms, which a small factor (16) covers."""
    pytest.importorskip("triton.runtime.interpreter")
    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    bound = 16 * (2 * (MODEL_VOCAB // 2 + 16) + 8) * U
    for got in run_distributed(_model_rank, 2, env=env):
        assert got["triton"]["path"] == "Triton", got["triton"]["path"]
        assert got["megatron"]["path"] == "megatron's (cross_entropy_loss_fusion is off)"
        assert not got["megatron"]["launches"], got["megatron"]["launches"]
        # The main loss and the MTP depth's: two of each kernel.
        launches = got["triton"]["launches"]
        assert launches.count("row_statistics_kernel") == 2, launches
        assert launches.count("cross_entropy_backward_kernel") == 2, launches
        errors = got["triton"]["error"]
        assert len(errors) > 10, errors  # every parameter, not a few
        worst = max(errors.items(), key=lambda item: item[1])
        assert worst[1] <= bound, (worst, bound)
        control = got["control"]["error"]
        assert max(control.values()) > 1000 * bound, control

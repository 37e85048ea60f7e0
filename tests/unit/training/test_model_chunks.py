"""``build_model_chunks`` wraps the model as training needs it (two gloo ranks, EP=2)."""

from __future__ import annotations

import pytest
import torch


def ddp_flag_worker(rank: int, world_size: int, delay: bool) -> bool:
    """The DDP config's ``delay_wgrad_compute`` of a chunk built for a model config with it."""
    from megatron_hybrid.runtime.cpu import enable_cpu_emulation

    enable_cpu_emulation()
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import small_config
    from megatron_hybrid.training.loop import build_model_chunks

    pattern = "[*E]{2}"
    pg = initialize_model_parallel(ep=2, seed=1)
    config = small_config(
        pattern, expert_model_parallel_size=2, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, overlap_moe_expert_parallel_comm=True,
        delay_wgrad_compute=delay,
    )  # fmt: skip
    chunks = build_model_chunks(
        config, pattern, pg, backend="local", vocab_size=128, max_sequence_length=16
    )
    return chunks[0].ddp_config.delay_wgrad_compute


@pytest.mark.distributed
@pytest.mark.parametrize("delay", [True, False], ids=["delay-wgrad", "no-delay"])
def test_ddp_follows_delay_wgrad_compute(delay):
    """TE's delayed wgrad reaches main_grad only through the hooks DDP registers under this flag."""
    from megatron_hybrid.testing.spawn import run_distributed

    assert run_distributed(ddp_flag_worker, 2, delay, timeout=300) == [delay, delay]


def test_gradient_scaling_is_megatrons_bit_for_bit(pg):
    """``finalize_model_grads``' division by the token count (a 0-d tensor) in one multi-tensor
    multiply gives every buffer and extra main grad megatron's own ``scale_gradients`` result
    bit for bit (on a CPU ``_foreach_mul_`` multiplies tensor by tensor; the one-kernel CUDA
    path is ``tests/functional/test_fused_step_gpu.py``'s). Controls: a factor one float32 step
    away changes the gradients, so equality is not vacuous; a buffer whose class scales in its
    own way is left to it."""
    from megatron.core.distributed import DistributedDataParallel
    from step_setup import tiny_training

    from megatron_hybrid.training.loop import TrainDistributedDataParallel

    chunk = tiny_training(pg).chunks[0]
    assert isinstance(chunk, TrainDistributedDataParallel)
    buffers = chunk.buffers + chunk.expert_parallel_buffers
    buffers[0].extra_main_grads.append(torch.empty(100))
    grads = [g for b in buffers for g in (b.grad_data, *b.extra_main_grads)]
    assert sum(g.numel() for g in grads) > 1000
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(g.shape, generator=gen) * 10 ** torch.randn(g.shape, generator=gen)
              for g in grads]  # fmt: skip
    factor = torch.tensor(1.0) / 4093  # as finalize_model_grads makes it

    def scaled(scale, value):
        for grad, start in zip(grads, values, strict=True):
            grad.copy_(start)
        scale(value)
        return [g.clone() for g in grads]

    ours = scaled(chunk.scale_gradients, factor)
    megatron = scaled(lambda f: DistributedDataParallel.scale_gradients(chunk, f), factor)
    assert all(torch.equal(a, b) for a, b in zip(ours, megatron, strict=True))
    nudged = scaled(chunk.scale_gradients, torch.nextafter(factor, torch.tensor(1.0)))
    assert not all(torch.equal(a, b) for a, b in zip(nudged, megatron, strict=True))

    class OwnScaling(type(buffers[0])):
        def scale_gradients(self, scaling_factor):
            self.grad_data.fill_(7.0)

    buffers[0].__class__ = OwnScaling
    chunk.scale_gradients(factor)
    assert bool((buffers[0].grad_data == 7.0).all())
    buffers[0].extra_main_grads.pop()


def test_deferred_scaling_records_the_factor_and_falls_back_to_applying_it(pg):
    """Inside ``deferred_gradient_scaling`` the buffers keep their gradients and the factor is
    recorded; one factor per chunk, the same tensor, is handed over; anything else is applied as
    recorded. A chunk whose buffer scales its own way defers nothing."""
    from step_setup import tiny_training

    from megatron_hybrid.training.loop import deferred_gradient_scaling, take_deferred_scaling

    chunks = tiny_training(pg).chunks
    chunk = chunks[0]
    data = chunk.buffers[0].grad_data
    data.fill_(3.0)
    factor = torch.tensor(0.5)
    with deferred_gradient_scaling(chunks) as factors:
        chunk.scale_gradients(factor)
    assert bool((data == 3.0).all()) and take_deferred_scaling(chunks, factors) is factor
    assert chunk.deferred_scaling is None  # eager again outside
    with deferred_gradient_scaling(chunks) as factors:
        chunk.scale_gradients(factor)
        chunk.scale_gradients(factor)  # a second time: not one factor per chunk
    assert take_deferred_scaling(chunks, factors) is None
    assert bool((data == 0.75).all())  # both applied here (the control of the handover)
    with deferred_gradient_scaling(chunks, wanted=False) as factors:
        chunk.scale_gradients(factor)
    assert not factors and bool((data == 0.375).all())

    class OwnScaling(type(chunk.buffers[0])):
        def scale_gradients(self, scaling_factor):
            self.grad_data.fill_(7.0)

    chunk.buffers[0].__class__ = OwnScaling
    with deferred_gradient_scaling(chunks) as factors:
        chunk.scale_gradients(factor)
    assert not factors and bool((data == 7.0).all())


def _three_steps(pg, monkeypatch, deferred: bool, drop: bool = False):
    """Losses, gradient norms and parameters of three ``train_step`` s of the tiny setup."""
    from step_setup import step, tiny_training

    import megatron_hybrid.training.loop as loop

    original = loop.deferred_gradient_scaling
    monkeypatch.setattr(
        loop, "deferred_gradient_scaling", lambda chunks, wanted=True: original(chunks, deferred)
    )
    if drop:
        monkeypatch.setattr(loop, "take_deferred_scaling", lambda chunks, factors: None)
    setup = tiny_training(pg)
    results = [step(setup, pg, setup.batches(i)) for i in range(3)]
    params = [p.detach().clone() for chunk in setup.chunks for p in chunk.parameters()]
    return [r.loss for r in results], [r.grad_norm for r in results], params


def test_train_step_with_the_token_factor_deferred_equals_scaling_first(pg, monkeypatch):
    """``train_step`` (fused step) leaves the token count's factor to AdamW's kernel: losses,
    norms and parameters over three steps as with the buffers scaled first, within float32
    rounding. Control: the factor dropped leaves the norm the unscaled sums' (tokens times
    larger)."""
    losses, norms, params = _three_steps(pg, monkeypatch, deferred=True)
    monkeypatch.undo()
    eager_losses, eager_norms, eager_params = _three_steps(pg, monkeypatch, deferred=False)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert norms == pytest.approx(eager_norms, rel=1e-5)
    for ours, theirs in zip(params, eager_params, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    _, dropped_norms, _ = _three_steps(pg, monkeypatch, deferred=True, drop=True)
    assert dropped_norms[0] > 10 * eager_norms[0]


def _step_with_a_huge_gradient(pg, monkeypatch, deferred: bool):
    """One ``train_step`` of the tiny setup with one gradient element of 1e20 before the token
    division (finite; its square is not, the divided one's is); the result and how often the
    step was taken again in megatron's order."""
    from step_setup import step, tiny_training

    import megatron_hybrid.training.loop as loop

    original_defer, original_scale = loop.deferred_gradient_scaling, loop._step_scaled_first
    original_buffers = loop.TrainDistributedDataParallel.scale_gradients
    monkeypatch.setattr(
        loop,
        "deferred_gradient_scaling",
        lambda chunks, wanted=True: original_defer(chunks, deferred),
    )

    def scale_gradients(self, factor):
        self.buffers[0].grad_data[0] = 1e20
        original_buffers(self, factor)

    monkeypatch.setattr(loop.TrainDistributedDataParallel, "scale_gradients", scale_gradients)
    again = []
    monkeypatch.setattr(
        loop, "_step_scaled_first", lambda *args: again.append(1) or original_scale(*args)
    )
    setup = tiny_training(pg)
    result = step(setup, pg, setup.batches(0))
    params = [p.detach().clone() for chunk in setup.chunks for p in chunk.parameters()]
    return result, params, len(again)


def test_an_overflow_of_the_unscaled_norm_is_decided_in_megatrons_order(pg, monkeypatch):
    """A gradient whose unscaled square overflows float32 while the divided one's does not:
    the deferred step is flagged, taken again in megatron's order, and ends as scaling first
    does (finite, the same norm and parameters). Control: the deferred attempt was flagged (the
    step was taken again), and scaling first never is."""
    result, params, again = _step_with_a_huge_gradient(pg, monkeypatch, deferred=True)
    monkeypatch.undo()
    eager, eager_params, eager_again = _step_with_a_huge_gradient(pg, monkeypatch, deferred=False)
    assert (again, eager_again) == (1, 0)
    assert result.finite and eager.finite
    assert 1e17 < result.grad_norm < 1e20
    assert result.grad_norm == pytest.approx(eager.grad_norm, rel=1e-6)
    for ours, theirs in zip(params, eager_params, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)

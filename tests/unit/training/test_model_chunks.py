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

"""A tiny ``train`` setup on the CPU for step-level tests: its config, chunks, optimizer, data."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_hybrid.pattern import parse_pattern

FLAGS = (
    "--hidden-size", "16", "--num-attention-heads", "2", "--swiglu", "--disable-bias-linear",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8",
    "--vocab-size", "32", "--seq-length", "12",
)  # fmt: skip


def tiny_training(pg, pattern: str = "[*E]", *, micro_batches: int = 2, clip_grad: float = 1.0,
                  lr: float = 1e-2, seed: int = 3):  # fmt: skip
    """``train``'s config, chunks, optimizer and micro-batch builder for ``pattern``."""
    import torch

    from megatron_hybrid.data.batches import build_micro_batch
    from megatron_hybrid.data.samples import TokenSample
    from megatron_hybrid.data.synthetic import SyntheticTokens
    from megatron_hybrid.padding import padding_config_from
    from megatron_hybrid.runtime.cpu import cpu_config_overrides
    from megatron_hybrid.training.config import config_from_flags
    from megatron_hybrid.training.loop import build_model_chunks
    from megatron_hybrid.training.optimizers import build_optimizer

    config = config_from_flags(pattern, *FLAGS, **cpu_config_overrides())
    torch.manual_seed(seed)
    chunks = build_model_chunks(
        config, parse_pattern(pattern), pg, backend="local", vocab_size=32, max_sequence_length=12
    )
    optimizer = build_optimizer(chunks, config, lr=lr, weight_decay=0.01, clip_grad=clip_grad,
                                pg=pg)  # fmt: skip
    data = SyntheticTokens(vocab_size=32, max_length=12, seed=seed)
    padding = padding_config_from(config, pg)

    def batches(step: int) -> list[dict]:
        first = step * micro_batches * 2
        return [
            build_micro_batch(
                [TokenSample(data.sequence(first + 2 * m + b)) for b in range(2)],
                padding,
                packed=False,
            ).step_inputs()
            for m in range(micro_batches)
        ]

    return SimpleNamespace(config=config, chunks=chunks, optimizer=optimizer, batches=batches,
                           pattern=parse_pattern(pattern))  # fmt: skip


def step(setup, pg, batches, **kwargs):
    """``train_step`` on ``batches`` with the setup's chunks and optimizer."""
    from megatron_hybrid.training.loop import train_step

    return train_step(setup.chunks, setup.optimizer, batches, setup.config, seq_length=12,
                      micro_batch_size=2, pg_collection=pg, **kwargs)  # fmt: skip

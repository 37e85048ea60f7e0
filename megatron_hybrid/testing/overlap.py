"""Run one model with and without EP overlap and collect what must match (tests, GPU checks).

:func:`compare_overlap` builds a model chunk list twice from the same weights — once for the
plain schedule, once with ``overlap_moe_expert_parallel_comm`` — runs megatron-core's
``get_forward_backward_func()`` on the same micro-batches for several steps and returns
per-micro-batch losses and final gradients of both, keyed by parameter name. Chunks wrapped in
megatron's ``DistributedDataParallel`` are read through their ``main_grad`` buffers, where
delayed weight gradients land (see :func:`parameter_grad`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_hybrid.schedule import steps

__all__ = ["compare_overlap", "parameter_grad", "rel_error", "run_schedule"]


def parameter_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient megatron accumulated for ``param``: ``main_grad`` under DDP, else ``grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def rel_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``|a - r| / |r|`` in Frobenius norms, computed in float32."""
    diff = (actual.float() - reference.float()).norm()
    return (diff / reference.float().norm().clamp_min(1e-30)).item()


def _zero_grads(chunk) -> None:
    if hasattr(chunk, "zero_grad_buffer"):  # DDP: main_grad lives in its buffers
        chunk.zero_grad_buffer()
    chunk.zero_grad(set_to_none=True)


def _batches(count: int, micro_batch_size: int, seq_length: int, vocab: int, seed: int, device):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (micro_batch_size, seq_length + 1), generator=generator)
        batches.append(
            dict(
                input_ids=tokens[:, :-1].contiguous().to(device),
                labels=tokens[:, 1:].contiguous().to(device),
                position_ids=torch.arange(seq_length, device=device)
                .unsqueeze(0)
                .expand(micro_batch_size, -1)
                .contiguous(),
                loss_mask=torch.ones(micro_batch_size, seq_length, device=device),
                attention_mask=None,
            )
        )
    return batches


def run_schedule(models, batches, config, *, seq_length, micro_batch_size, optimizer=None):
    """One training step over ``batches`` with megatron-core's schedule for ``config``."""
    for model in models:
        model.config.finalize_model_grads_func = None
    losses = steps.run_schedule(models, list(batches), seq_length=seq_length,
                                micro_batch_size=micro_batch_size, forward_only=False)  # fmt: skip
    return [(d["lm loss"][0] / d["lm loss"][1]).item() for d in losses]


def compare_overlap(
    build_chunks,
    config,
    *,
    steps: int = 1,
    num_microbatches: int = 4,
    micro_batch_size: int = 2,
    seq_length: int = 16,
    vocab: int = 128,
    lr: float = 0.0,
    seed: int = 11,
    overlap_overrides: dict | None = None,
    schedules: tuple[str, ...] = ("plain", "overlap"),
) -> dict[str, Any]:
    """Losses and gradients of the plain and the overlapped schedule on the same weights.

    Args:
        build_chunks: ``config -> list of model chunks`` on this rank (already wrapped for
            bf16, e.g. in ``Float16Module``, and optionally in megatron's DDP, which
            ``delay_wgrad_compute`` with TE linears needs).
        config: the model config without overlap; the overlapped run sets
            ``overlap_moe_expert_parallel_comm=True``.
        steps: training steps (SGD with ``lr`` between steps, the same for both runs).
        num_microbatches: micro-batches per step.
        micro_batch_size: sequences per micro-batch.
        seq_length: tokens per sequence.
        vocab: vocabulary size of the synthetic tokens.
        lr: SGD learning rate; 0 keeps the weights fixed.
        seed: data seed.
        overlap_overrides: config changes for the overlapped run only (e.g. recompute).
        schedules: which of ``"plain"`` and ``"overlap"`` to run, in this order.

    Returns:
        ``{"plain": run, "overlap": run}`` (the schedules run), each run ``{"losses": [...],
        "grads": [per step: {name: grad}]}``.
    """
    valid = set(schedules) <= {"plain", "overlap"} and len(set(schedules)) == len(schedules)
    if not schedules or not valid:
        raise ValueError(
            f"schedules must name 'plain' and/or 'overlap', each once, got {schedules!r}"
        )
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    results = {}
    state = None
    for name in schedules:
        overlap = name == "overlap"
        changes = dict(overlap_overrides or {}) if overlap else {}
        run_config = dataclasses.replace(
            config, overlap_moe_expert_parallel_comm=overlap, **changes
        )
        chunks = build_chunks(run_config)
        if state is None:
            state = [
                {
                    k: v.detach().clone() if torch.is_tensor(v) else v
                    for k, v in chunk.state_dict().items()
                }
                for chunk in chunks
            ]
        else:
            for chunk, chunk_state in zip(chunks, state, strict=True):
                chunk.load_state_dict(chunk_state)
        losses, grads = [], []
        for step in range(steps):
            for chunk in chunks:
                _zero_grads(chunk)
            batches = _batches(
                num_microbatches, micro_batch_size, seq_length, vocab, seed + step, device
            )
            losses.extend(
                run_schedule(
                    chunks,
                    batches,
                    run_config,
                    seq_length=seq_length,
                    micro_batch_size=micro_batch_size,
                )
            )
            grads.append(
                {
                    f"{i}.{n}": parameter_grad(p).detach().float().clone()
                    for i, chunk in enumerate(chunks)
                    for n, p in chunk.named_parameters()
                    if parameter_grad(p) is not None
                }
            )
            if lr and step < steps - 1:
                with torch.no_grad():
                    for chunk in chunks:
                        for p in chunk.parameters():
                            if (grad := parameter_grad(p)) is not None:
                                p.add_(grad.to(p.dtype), alpha=-lr)
        results[name] = {"losses": losses, "grads": grads}
    return results

"""Pieces the benchmarks share: the recorded command, the host's CPU, device syncs, synthetic
batches, the MoE models' ``TransformerConfig``, and the Qwen3.5-MoE text config their model
presets fill in."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

#: Where results live in the repository; a run's own ``--out`` folder is written as this.
RESULTS = "benchmarks/results"


def recorded_command(script: str, argv: list[str], launcher: str = "python") -> str:
    """``<launcher> benchmarks/<script> ARGS`` as run, its ``--out`` folder shown as the
    repository's results folder (a machine's output path does not belong in the record).

    ``launcher`` is what started the script, e.g. ``NCCL_P2P_DISABLE=1 torchrun
    --nproc_per_node 4`` for a distributed benchmark.

    >>> recorded_command("x.py", ["--out", "/tmp/o", "--steps", "3"], launcher="torchrun")
    'torchrun benchmarks/x.py --out benchmarks/results --steps 3'
    """
    shown = list(argv)
    for i, arg in enumerate(shown[:-1]):
        if arg == "--out":
            shown[i + 1] = RESULTS
    return " ".join([f"{launcher} benchmarks/{script}", *shown])


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def host_cpu() -> str:
    """The CPU and the cores this process may use: a host-paced call (most of a GPU step at
    these shapes) runs at the host's speed, so results record it (one H200 scored the same
    log-probs code at 144,871 and 86,985 tokens/s on two hosts, 2026-11-28)."""
    return f"{cpu_name()}, {len(os.sched_getaffinity(0))} of {os.cpu_count()} cores"


def host_profile(call, top: int) -> dict:
    """``call()`` once under cProfile (after a device wait): its wall time, Python function
    calls, and the ``top`` functions by own time (a call that waits for the device shows the
    wait as its own time)."""
    import cProfile
    import pstats
    import time

    profiler = cProfile.Profile()
    sync()
    began = time.perf_counter()
    profiler.enable()
    call()
    sync()
    profiler.disable()
    step_ms = 1e3 * (time.perf_counter() - began)
    stats = pstats.Stats(profiler).stats
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
        where = f"{Path(path).name}:{line}" if line else path
        rows.append(dict(function=f"{where}({name})", calls=calls, own_ms=1e3 * own,
                         cumulative_ms=1e3 * cumulative))  # fmt: skip
    rows.sort(key=lambda row: row["own_ms"], reverse=True)
    return dict(step_ms=step_ms, function_calls=sum(r["calls"] for r in rows), top=rows[:top])


def sync(device=None) -> None:
    """Wait for the GPU (``device`` None: whenever CUDA is there), so a timer sees its work."""
    if torch.cuda.is_available() if device is None else torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def moe_bench_config(args, *, num_layers: int, ep: int, **changes):
    """The bf16 MoE ``TransformerConfig`` of the EP benchmarks (``ep_overlap.py``,
    ``hybridep.py``): ``args`` gives ``hidden``, ``heads``, ``experts``, ``topk`` and
    ``expert_hidden``; alltoall dispatcher, no biases, dropout or auxiliary loss; ``changes``
    override or add fields. On a CPU (smoke runs) the CPU emulation's overrides apply too."""
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=num_layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_ffn_hidden_size=args.expert_hidden,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ep, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )  # fmt: skip
    fields.update(changes)
    if not torch.cuda.is_available():
        from megatron_hybrid.runtime.cpu import cpu_config_overrides

        fields.update(cpu_config_overrides())
    return TransformerConfig(**fields)


def synthetic_batches(shape, count: int, device=None) -> list[dict]:
    """``count`` micro-batches of random tokens for megatron's schedule; ``shape`` has
    ``vocab``, ``mbs`` and ``seq`` (a benchmark's shape or its parsed arguments)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, shape.vocab, (shape.mbs, shape.seq + 1), generator=generator)
        batches.append(dict(
            input_ids=tokens[:, :-1].to(device), labels=tokens[:, 1:].to(device),
            position_ids=torch.arange(shape.seq, device=device).expand(shape.mbs, -1),
            loss_mask=torch.ones(shape.mbs, shape.seq, device=device), attention_mask=None,
        ))  # fmt: skip
    return batches


def qwen3_5_moe_text_config(sizes: dict, max_position_embeddings: int) -> dict:
    """A ``qwen3_5_moe_text`` config.json dict with a preset's ``sizes`` (bf16, SwiGLU)."""
    return dict(
        model_type="qwen3_5_moe_text",
        dtype="bfloat16",
        rms_norm_eps=1e-6,
        hidden_act="silu",
        linear_conv_kernel_dim=4,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        **sizes,
    )

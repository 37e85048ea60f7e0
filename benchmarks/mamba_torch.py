"""Tokens/s of one Mamba layer: the torch Mamba2 path vs megatron-core's kernels (one GPU).

    python benchmarks/mamba_torch.py --out benchmarks/results
    python benchmarks/mamba_torch.py --seq 4096 --batch 2 --hidden 2048   # the defaults

Builds one ``MambaLayer`` (input norm, mixer, residual) from ``hybrid_stack_spec("local",
mamba_impl=...)`` for ``torch`` and ``kernels`` (megatron-core's ``MambaMixer`` on mamba_ssm and
causal_conv1d) with the same weights, and times forward and forward+backward steps at each
sequence length (median of ``--steps`` after ``--warmup``). Reports tokens/s, the torch path's
slowdown and peak memory, so users know what the fallback costs. Adds its rows to
``mamba_torch_<device>.{json,md}`` in ``--out``.

Where the kernels cannot run (no mamba_ssm or causal_conv1d, or no GPU) the torch side is still
measured and reported, then the script exits with code 2 and says why. On a CPU it runs the
torch side in float32 (use small ``--hidden``/``--seq``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _setup():
    """``(device, process groups)`` of a one-process world."""
    from megatron_hybrid.process_groups import init_single_process_world, initialize_model_parallel

    if torch.cuda.is_available():
        init_single_process_world("nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        from megatron_hybrid.runtime.cpu import enable_cpu_emulation

        enable_cpu_emulation()
        init_single_process_world("gloo")
        device = torch.device("cpu")
    return device, initialize_model_parallel(tp=1, seed=1234)


def _layer(impl: str, args, dtype: torch.dtype, device: torch.device, pg):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from megatron_hybrid import hybrid_stack_spec
    from megatron_hybrid.testing.models import small_config

    config = small_config(
        "M",
        hidden_size=args.hidden,
        num_attention_heads=8,
        mamba_state_dim=args.state,
        mamba_head_dim=args.head_dim,
        mamba_num_groups=args.groups,
        normalization="RMSNorm",
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
    )
    spec = hybrid_stack_spec("local", config=config, mamba_impl=impl).submodules.mamba_layer
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)  # same seed: both implementations get the same weights
    return build_module(spec, config=config, layer_number=1, pg_collection=pg).to(device)


def _median_seconds(fn, steps: int, warmup: int, device: torch.device) -> float:
    times = []
    for step in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(impl: str, seq: int, args, dtype, device, pg) -> dict:
    """Forward and forward+backward tokens/s of one layer at sequence length ``seq``."""
    layer = _layer(impl, args, dtype, device, pg)
    gen = torch.Generator().manual_seed(seq)
    hidden = torch.randn(seq, args.batch, args.hidden, generator=gen).to(device, dtype)
    hidden.requires_grad_(True)
    grad = torch.randn_like(hidden)

    def forward():
        with torch.no_grad():
            layer(hidden)

    def train_step():
        layer(hidden).backward(grad)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    fwd = _median_seconds(forward, args.steps, args.warmup, device)
    step = _median_seconds(train_step, args.steps, args.warmup, device)
    tokens = seq * args.batch
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return dict(
        impl=impl,
        seq=seq,
        fwd_tok_s=tokens / fwd,
        fwd_bwd_tok_s=tokens / step,
        fwd_bwd_ms=step * 1e3,
        peak_gib=peak,
    )


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# One Mamba layer: torch Mamba2 path vs megatron-core kernels ({meta['device']})",
        "",
        f"{meta['date']}; hidden {meta['hidden']}, batch {meta['batch']}, state "
        f"{meta['state']}, head dim {meta['head_dim']}, groups {meta['groups']}, "
        f"{meta['dtype']}, chunk 128; median of {meta['steps']} steps after {meta['warmup']}.",
        "",
        "| seq | impl | fwd tok/s | fwd+bwd tok/s | fwd+bwd ms | peak GiB | kernels / torch |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    kernels = {r["seq"]: r for r in rows if r["impl"] == "kernels"}
    for r in rows:
        ratio = ""
        if r["impl"] == "torch" and r["seq"] in kernels:
            ratio = f"{kernels[r['seq']]['fwd_bwd_tok_s'] / r['fwd_bwd_tok_s']:.1f}x"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        lines.append(
            f"| {r['seq']} | {r['impl']} | {r['fwd_tok_s']:,.0f} | {r['fwd_bwd_tok_s']:,.0f} | "
            f"{r['fwd_bwd_ms']:.1f} | {peak} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 4096], help="sequence lengths")
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size")
    parser.add_argument("--state", type=int, default=128, help="mamba_state_dim")
    parser.add_argument("--head-dim", type=int, default=64, help="mamba_head_dim")
    parser.add_argument("--groups", type=int, default=8, help="mamba_num_groups")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per figure")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--out", type=Path, default=None, help="folder for the results files")
    args = parser.parse_args()

    device, pg = _setup()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from megatron_hybrid.modules.mamba_torch import mamba_kernels_available

    available, reason = mamba_kernels_available()
    rows = []
    for seq in args.seq:
        for impl in ("torch", "kernels") if available else ("torch",):
            rows.append(measure(impl, seq, args, dtype, device, pg))
            print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    meta = dict(
        device=name,
        date=datetime.date.today().isoformat(),
        dtype=str(dtype).removeprefix("torch."),
        **{k: getattr(args, k) for k in ("hidden", "batch", "state", "head_dim", "groups")},
        steps=args.steps,
        warmup=args.warmup,
    )
    table = _markdown(rows, meta)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"mamba_torch_{'gpu' if device.type == 'cuda' else 'cpu'}"
        stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        stem.with_suffix(".md").write_text(table)
    if not available:
        print(
            f"mamba_torch.py: measured the torch path only: megatron-core's kernels cannot run "
            f"here ({reason}); install mamba-ssm and causal-conv1d on a CUDA machine",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

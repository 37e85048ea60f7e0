"""Host time and GPU idle per `[GE]` layer step, eager vs CUDA-graphed pieces (one GPU).

    torchrun --nproc_per_node 1 benchmarks/cuda_graphs.py --out benchmarks/results [--steps N]

The EP-overlap profile (``docs/ep_overlap.md``) found the overlapped `[GE]{4}` step host-bound at
micro-batch 1: its GPU idled 394 of 812 ms while the host launched small GatedDeltaNet and routing
kernels one by one. This benchmark measures what ``hybrid_cuda_graphs`` does to that launch cost,
on one GPU with the shapes of ``benchmarks/ep_overlap.py`` (hidden 2048, 16 heads, 16 experts top-4
with expert hidden 4096, sequence 4096, micro-batch 1, 8 micro-batches, 4 layers, bf16, local
specs). One GPU means EP=1, so it runs the plain schedule (the EP-overlap plan needs EP >= 2);
the pieces graphed are those the overlapped schedule replays too (GatedDeltaNet mixer, router).

Per variant (``eager``, ``graphed``): the median step time over ``--steps`` steps after
``--warmup`` (the graphed variant captures in its first warm-up step), then one profiled step
summarised by ``trace_summary.py``: GPU busy and idle, CPU time in operators and kernel launches.
Per-layer figures divide by layers x micro-batches. Writes ``cuda_graphs_<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
from ep_overlap import add_shape_args, bench_config, profile_step, synthetic_batches

VARIANTS = ("eager", "graphed")


def _build(args, pg, graphed: bool):
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.testing.models import build_hybrid

    pattern = f"[GE]{{{args.layers}}}"
    config = bench_config(args, pattern, overlap=False, ep=1)
    torch.manual_seed(1234)
    model = build_hybrid(config, pattern, pg, vocab_size=args.vocab, max_sequence_length=args.seq,
                         hybrid_cuda_graphs=graphed).cuda()  # fmt: skip
    return Float16Module(config, model), config, model.hybrid_cuda_graphs


def measure(args, pg, variant: str) -> dict:
    """Step times and one profiled step's summary of one variant."""
    from megatron_hybrid.testing.overlap import run_schedule

    model, config, graphs = _build(args, pg, variant == "graphed")
    batches = synthetic_batches(args, args.microbatches)

    def step():
        run_schedule([model], batches, config, seq_length=args.seq, micro_batch_size=args.mbs)

    times = []
    for index in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if index >= args.warmup:
            times.append(time.perf_counter() - began)
    model.zero_grad(set_to_none=True)
    profile = profile_step(step, Path(args.out), f"cuda_graphs_{variant}")
    per = args.layers * args.microbatches
    window = profile["window_ms"]
    result = {
        "median_s": statistics.median(times),
        "steps_s": times,
        "profile": profile,
        "per_layer_step": {
            # The host is either issuing work (operators, launches, Python) or waiting in a
            # synchronisation; a replayed graph's launch is one call, not an operator.
            "host_ms": (window - profile["cpu_sync_wait_ms"]) / per,
            "host_op_ms": profile["cpu_op_busy_ms"] / per,
            "launches": profile["cpu_launches"] / per,
            "gpu_busy_ms": profile["gpu_busy_ms"] / per,
            "gpu_idle_fraction": profile["gpu_idle_ms"] / window,
        },
    }
    if graphs is not None:
        result["graphs"] = graphs.summary().splitlines()
    torch.cuda.empty_cache()
    return result


def write(args, results: dict) -> None:
    device = torch.cuda.get_device_name().replace(" ", "-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "command": "torchrun --nproc_per_node 1 benchmarks/cuda_graphs.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in sorted(vars(args).items())
        ),
    }
    (out / f"cuda_graphs_{device}.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1)
    )
    rows = [
        "| variant | step s | host ms / layer step (in operators) | kernel launches / layer step "
        "| GPU busy ms / layer step | GPU idle fraction |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for variant, r in results.items():
        p = r["per_layer_step"]
        rows.append(
            f"| {variant} | {r['median_s']:.3f} | {p['host_ms']:.2f} ({p['host_op_ms']:.2f}) "
            f"| {p['launches']:.0f} "
            f"| {p['gpu_busy_ms']:.2f} | {p['gpu_idle_fraction']:.3f} |"
        )
    graphs = [f"* {line}" for r in results.values() for line in r.get("graphs", [])]
    text = "\n".join([f"# CUDA graphs, `[GE]{{{args.layers}}}`, {device}", "", *rows, "",
                      "Pieces of the graphed variant:", "", *graphs, "",
                      f"`{meta['command']}`", ""])  # fmt: skip
    (out / f"cuda_graphs_{device}.md").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    add_shape_args(parser)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--gdn-kernel", choices=("torch", "fla"), default="torch",
        help="megatron's torch GatedDeltaNet path, or fla's Triton kernels (their backward needs "
        "Triton >= 3.7.1 on Hopper)",
    )  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available() or os.environ.get("WORLD_SIZE") != "1":
        parser.error("run it on one GPU under torchrun --nproc_per_node 1")
    if args.warmup < 1:
        parser.error(f"--warmup must be at least 1 (graphs are captured then), got {args.warmup}")

    from megatron_hybrid.process_groups import initialize_model_parallel

    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl")
    pg = initialize_model_parallel(ep=1, seed=5)
    results = {variant: measure(args, pg, variant) for variant in args.variants}
    write(args, results)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

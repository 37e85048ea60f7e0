"""EP-overlap benchmark: grouped HybridModel vs GPTModel, with and without overlap (torchrun).

    torchrun --nproc_per_node 2 benchmarks/ep_overlap.py --label nvlink --out benchmarks/results
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node 2 benchmarks/ep_overlap.py --label no-p2p ...

Every variant is built from the same seed: hidden 2048, 16 heads, 16 experts top-4 (expert
hidden 4096), sequence 4096, micro-batch 1, 8 micro-batches per step, bf16, ``local`` backend,
alltoall dispatcher, EP = number of GPUs. A step is the forward and backward pass of one global
batch through megatron-core's ``get_forward_backward_func()`` (the optimizer update, the same
for every variant, is left out). Reported: median step time over the measured steps and peak
allocated GPU memory. Variants:

* ``gpt_overlap`` / ``gpt_plain`` — GPTModel with L MoE layers (the reference);
* ``grouped_overlap`` / ``grouped_plain`` — ``[*E]{L}``, the same layers grouped;
* ``ungrouped_plain`` — ``*E`` repeated L times: megatron-core's hybrid layer structure (its
  HybridModel has no schedule plan, so no overlap);
* ``ge_plain`` / ``ge_overlap`` — ``[GE]{L}`` (GatedDeltaNet + MoE, which GPTModel cannot express).

Writes ``ep_overlap_<label>_<N>gpu.{json,md,png}`` into ``--out``. ``--repeats R`` measures the
variants round-robin R times (each round builds each model afresh), so slow drift of the machine
spreads over all variants; the median is taken over the steps of all rounds and the per-round
ratios show the spread. ``--profile`` adds one profiled step per variant (after the timed ones):
a summary of where the step's time goes (``trace_summary.py``) and rank 0's Chrome trace.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import moe_bench_config, sync, synthetic_batches
from trace_summary import record_trace, summarize_trace

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


VARIANTS = (
    "gpt_plain", "gpt_overlap", "grouped_plain", "grouped_overlap", "ungrouped_plain",
    "ge_plain", "ge_overlap",
)  # fmt: skip


def bench_config(args, pattern: str, overlap: bool, ep: int):
    from megatron_hybrid.pattern import parse_pattern

    parsed = parse_pattern(pattern)
    extra = {}
    if parsed.layer_counts["G"] > 0:
        # GatedDeltaNet takes the model's activation, which must be SiLU. deterministic_mode
        # selects megatron's torch GDN path; fla's kernels need Triton >= 3.7.1 on Hopper for
        # their gated backward (fla 0.6.0 refuses older Triton there: wrong results, fla #640).
        extra = dict(activation_func=torch.nn.functional.silu, gated_linear_unit=True,
                     linear_num_key_heads=16, linear_num_value_heads=16,
                     linear_key_head_dim=128, linear_value_head_dim=128,
                     deterministic_mode=args.gdn_kernel == "torch")  # fmt: skip
    return moe_bench_config(
        args, num_layers=parsed.physical_layer_count, ep=ep, moe_grouped_gemm=False,
        overlap_moe_expert_parallel_comm=overlap, **extra,
    )  # fmt: skip


def _build(variant: str, args, pg, ep: int):
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.testing.models import build_gpt_twin, build_hybrid

    layers = args.layers
    pattern = {
        "gpt": f"[*E]{{{layers}}}",
        "grouped": f"[*E]{{{layers}}}",
        "ungrouped": "*E" * layers,
        "ge": f"[GE]{{{layers}}}",
    }[variant.split("_")[0]]
    overlap = variant.endswith("overlap")
    config = bench_config(args, pattern, overlap, ep)
    builder = build_gpt_twin if variant.startswith("gpt") else build_hybrid
    torch.manual_seed(1234)
    model = builder(config, pattern, pg, vocab_size=args.vocab,
                    max_sequence_length=args.seq).to(DEVICE)  # fmt: skip
    return Float16Module(config, model), config


def profile_step(step, out: Path, name: str) -> dict:
    """One step under torch.profiler: its summary, and rank 0's trace written to ``out``."""
    _, text = record_trace(step, sync)
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        with gzip.open(out / f"{name}.trace.json.gz", "wt") as f:
            f.write(text)
    return summarize_trace(json.loads(text)["traceEvents"])


def measure(variant: str, args, pg, ep: int, profile_as: str | None = None) -> dict:
    """Step times and peak memory of one variant (and a profile summary with ``profile_as``)."""
    from megatron_hybrid.testing.overlap import run_schedule

    model, config = _build(variant, args, pg, ep)
    chunks, batches = [model], synthetic_batches(args, args.microbatches)

    def step():
        run_schedule(chunks, batches, config, seq_length=args.seq, micro_batch_size=args.mbs)

    # The torch GatedDeltaNet path is slow at this size: fewer steps keep the run short.
    slow = variant.startswith("ge") and args.gdn_kernel == "torch"
    warmup, steps = (1, max(2, args.steps // 2)) if slow else (args.warmup, args.steps)
    times = []
    for index in range(warmup + steps):
        if index == warmup and CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        sync()
        began = time.perf_counter()
        step()
        sync()
        if index >= warmup:
            times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0
    profiled = None
    if profile_as is not None:
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        profiled = profile_step(step, Path(args.out), profile_as)
    # The slowest rank decides the step; take each step's max over ranks.
    t = torch.tensor(times, device=DEVICE)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    m = torch.tensor([peak], device=DEVICE)
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX)
    chunks.clear()
    del model
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    result = {"median_s": statistics.median(t.tolist()), "steps_s": t.tolist(),
              "peak_gib": float(m.item())}  # fmt: skip
    if profiled is not None:
        result["profile"] = profiled
    return result


def merge_rounds(rounds: list[dict]) -> dict:
    """One variant's result over several rounds: median of all steps, per-round medians.

    >>> merge_rounds([{"median_s": 2.0, "steps_s": [1.0, 2.0, 3.0], "peak_gib": 1.0},
    ...               {"median_s": 5.0, "steps_s": [4.0, 5.0, 6.0], "peak_gib": 1.5}])["median_s"]
    3.5
    """
    merged = dict(rounds[-1])
    steps = [t for r in rounds for t in r["steps_s"]]
    merged.update(
        median_s=statistics.median(steps),
        steps_s=steps,
        round_medians_s=[r["median_s"] for r in rounds],
        peak_gib=max(r["peak_gib"] for r in rounds),
    )
    return merged


_RATIOS = {  # name: (numerator variant, denominator variant, key)
    "grouped_vs_gpt_overlap_time": ("grouped_overlap", "gpt_overlap", "median_s"),
    "grouped_vs_gpt_overlap_memory": ("grouped_overlap", "gpt_overlap", "peak_gib"),
    "gpt_overlap_speedup": ("gpt_plain", "gpt_overlap", "median_s"),
    "grouped_overlap_speedup": ("grouped_plain", "grouped_overlap", "median_s"),
    "ge_overlap_speedup": ("ge_plain", "ge_overlap", "median_s"),
    "grouped_plain_vs_ungrouped_plain_time": ("grouped_plain", "ungrouped_plain", "median_s"),
}


def summarize(results: dict) -> dict:
    """The ratios ``docs/architecture.md`` ("Guarantees and targets") sets targets for (None
    where a variant is missing)."""
    ratios = {}
    for name, (a, b, key) in _RATIOS.items():
        ok = a in results and b in results and results[b][key]
        ratios[name] = results[a][key] / results[b][key] if ok else None
    return ratios


def round_ratios(results: dict) -> dict:
    """Time ratios per round, where both variants were measured in the same rounds.

    Variants of one round ran back to back, so these pairings show how much of a ratio is noise.
    Variants merged from different runs (``--append``) are not paired.
    """
    out = {}
    for name, (a, b, key) in _RATIOS.items():
        if key != "median_s" or a not in results or b not in results:
            continue
        if results[a].get("run") != results[b].get("run"):
            continue
        ra, rb = results[a].get("round_medians_s"), results[b].get("round_medians_s")
        if ra and rb and len(ra) == len(rb) and len(ra) > 1:
            out[name] = [x / y for x, y in zip(ra, rb, strict=True)]
    return out


def write_outputs(out: Path, name: str, meta: dict, results: dict, ratios: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    per_round = round_ratios(results)
    (out / f"{name}.json").write_text(json.dumps(
        {"meta": meta, "results": results, "ratios": ratios, "round_ratios": per_round},
        indent=2))  # fmt: skip
    lines = [
        f"# EP overlap: {meta['label']}, {meta['gpus']} x {meta['gpu']}",
        "",
        f"Date {meta['date']}; command `{meta['command']}`; {meta['setup']}.",
        "",
        "| variant | median step (s) | per-round medians (s) | peak memory (GiB) |",
        "| --- | ---: | --- | ---: |",
    ]
    for v, r in results.items():
        rounds = ", ".join(f"{t:.4f}" for t in r.get("round_medians_s", [r["median_s"]]))
        lines.append(f"| {v} | {r['median_s']:.4f} | {rounds} | {r['peak_gib']:.2f} |")
    lines += ["", "| ratio | value | per round |", "| --- | ---: | --- |"]
    for k, v in ratios.items():
        if v is not None:
            spread = ", ".join(f"{x:.3f}" for x in per_round.get(k, []))
            lines.append(f"| {k} | {v:.3f} | {spread} |")
    profiled = {v: r["profile"] for v, r in results.items() if "profile" in r}
    if profiled:
        keys = list(next(iter(profiled.values())))
        lines += [
            "",
            "One profiled step per variant, rank 0 (torch.profiler, CPU+CUDA activity; the "
            "profiler's own overhead makes these steps longer than the timed ones). Times in ms.",
            "",
            "| variant | " + " | ".join(keys) + " |",
            "| --- |" + " ---: |" * len(keys),
        ]
        for v, p in profiled.items():
            cells = [f"{p[k]:.1f}" if isinstance(p[k], float) else str(p[k]) for k in keys]
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 3.5))
        ax1, ax2 = fig.subplots(1, 2)
        names = list(results)
        ax1.barh(names, [results[n]["median_s"] for n in names], color="tab:blue")
        ax1.set_xlabel("median step time (s)")
        ax2.barh(names, [results[n]["peak_gib"] for n in names], color="tab:orange")
        ax2.set_xlabel("peak memory (GiB)")
        ax2.set_yticklabels([])
        fig.suptitle(f"EP overlap, {meta['label']}, {meta['gpus']} GPUs")
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
    except ImportError:
        print("matplotlib missing: no chart written")


# Arguments that may differ between the runs merged by --append.
_PER_RUN_ARGS = ("variants", "append", "gdn_kernel", "out", "repeats", "profile")


def bind_cores(
    local_rank: int, count: int, parser: argparse.ArgumentParser, flag: str = "--bind-cores"
) -> list[int]:
    """Bind this rank to the ``local_rank``-th block of ``count`` allowed cores.

    Binds the calling thread only, before CUDA, NCCL and the autograd engine start their threads,
    which inherit the binding (threads already running, if any, keep theirs). Intra-op threads
    are capped at ``count``: more would spin against each other. ``flag`` names the option in
    the error.
    """
    allowed = sorted(os.sched_getaffinity(0))
    cores = allowed[local_rank * count : (local_rank + 1) * count]
    if len(cores) < count:
        parser.error(
            f"{flag} {count}: only {len(allowed)} cores are available here, but rank "
            f"{local_rank} needs cores {local_rank * count}..{(local_rank + 1) * count - 1} of "
            f"the {len(allowed)} allowed here; use fewer"
        )
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(min(torch.get_num_threads(), count))
    return cores


def _command(args, parser: argparse.ArgumentParser, ep: int) -> str:
    """The command line of this run: every argument that differs from its default."""
    extra = ""
    for action in parser._actions:
        dest = action.dest
        if dest in ("help", "label", "out") or getattr(args, dest) == action.default:
            continue
        value = getattr(args, dest)
        flag = action.option_strings[0]
        if isinstance(value, bool):
            extra += f" {flag}"
        elif isinstance(value, list):
            extra += f" {flag} " + " ".join(map(str, value))
        else:
            extra += f" {flag} {value}"
    network = "NCCL_P2P_DISABLE=1 " if os.environ.get("NCCL_P2P_DISABLE") == "1" else ""
    return (
        f"{network}torchrun --nproc_per_node {ep} benchmarks/ep_overlap.py --label {args.label}"
        + extra
    )


def _write(args, ep: int, results: dict, commands: list[str]) -> None:
    """Write JSON, Markdown and the chart for the variants measured so far."""
    ratios = summarize(results)
    gdn_kernels = sorted({r["gdn_kernel"] for r in results.values() if "gdn_kernel" in r})
    meta = dict(
        label=args.label,
        gpus=ep,
        gpu=torch.cuda.get_device_name() if CUDA else "CPU",
        date=datetime.date.today().isoformat(),
        command="`, then `".join(commands),
        commands=commands,
        setup=(
            f"hidden {args.hidden}, {args.experts} experts top-{args.topk} (expert hidden "
            f"{args.expert_hidden}), seq {args.seq}, mbs {args.mbs}, {args.microbatches} "
            f"micro-batches, {args.layers} layers, bf16, local backend, EP={ep}, "
            f"NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE', '0')}"
            + "".join(f", GatedDeltaNet kernels: {k}" for k in gdn_kernels)
        ),
        args={k: v for k, v in vars(args).items() if k != "out"},  # not where it was written
    )
    write_outputs(Path(args.out), f"ep_overlap_{args.label}_{ep}gpu", meta, results, ratios)


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """The model and batch shape flags (shared with ``cuda_graphs.py``, which measures the same
    shapes)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--expert-hidden", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="network setting, e.g. nvlink, no-p2p")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    add_shape_args(parser)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="measure the variants round-robin this many times (median over all rounds' steps)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="after the timed steps, profile one step per variant (last round): a summary in "
        "the results and rank 0's Chrome trace (<name>_<variant>.trace.json.gz) in --out",
    )  # fmt: skip
    parser.add_argument(
        "--gdn-kernel", choices=("torch", "fla"), default="torch",
        help="GatedDeltaNet kernels of the ge_* variants: megatron's torch path, or fla's Triton "
        "kernels (their backward needs Triton >= 3.7.1 on Hopper)",
    )  # fmt: skip
    parser.add_argument(
        "--append", action="store_true",
        help="keep the variants an earlier run of the same label and GPU count wrote, "
        "replacing those measured again (for variants run with another environment)",
    )  # fmt: skip
    parser.add_argument(
        "--bind-cores", type=int, default=0,
        help="bind each rank's main thread to its own N of the allowed cores before CUDA, NCCL and "
        "the autograd engine start theirs, which inherit it (rank r gets the r-th block of N; "
        "0: leave the binding alone)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.bind_cores < 0:
        parser.error(f"--bind-cores must be 0 or more, got {args.bind_cores}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.profile and not CUDA:
        parser.error("--profile summarises GPU kernels: run it on GPUs")

    # torchrun sets WORLD_SIZE: the --append checks need no process group, so they come first.
    ep = int(os.environ.get("WORLD_SIZE", "1"))
    variants = list(args.variants)
    if any(v.startswith("ge") for v in variants):
        try:
            import fla  # noqa: F401
        except ImportError:
            print("ge_* variants skipped: fla-core is not installed")
            variants = [v for v in variants if not v.startswith("ge")]
    results, commands = {}, [_command(args, parser, ep)]
    previous = Path(args.out) / f"ep_overlap_{args.label}_{ep}gpu.json"
    if args.append and previous.exists():
        earlier = json.loads(previous.read_text())
        results = {k: v for k, v in earlier["results"].items() if k not in variants}
        commands = earlier["meta"].get("commands", [earlier["meta"]["command"]]) + commands
        for key, value in earlier["meta"]["args"].items():
            now = vars(args).get(key)
            if key not in _PER_RUN_ARGS and now != value:
                parser.error(f"--append: {key} was {value!r} in {previous}, now {now!r}")

    if args.bind_cores:
        bind_cores(int(os.environ.get("LOCAL_RANK", "0")), args.bind_cores, parser)
    if CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
    else:  # a CPU smoke run (numbers meaningless): megatron-core needs its CUDA calls emulated
        from megatron_hybrid.runtime.cpu import enable_cpu_emulation

        enable_cpu_emulation()
        torch.distributed.init_process_group("gloo")
    from megatron_hybrid.process_groups import initialize_model_parallel

    assert torch.distributed.get_world_size() == ep, "WORLD_SIZE disagrees with the process group"
    rounds: dict[str, list[dict]] = {v: [] for v in variants}
    name = f"ep_overlap_{args.label}_{ep}gpu"
    for round_index in range(args.repeats):
        last_round = round_index == args.repeats - 1
        for variant in variants:
            pg = initialize_model_parallel(ep=ep, seed=1234)
            profile_as = f"{name}_{variant}" if args.profile and last_round else None
            rounds[variant].append(measure(variant, args, pg, ep, profile_as))
            results[variant] = merge_rounds(rounds[variant])
            results[variant]["run"] = len(commands) - 1  # rounds pair only within one run
            if variant.startswith("ge"):
                results[variant]["gdn_kernel"] = args.gdn_kernel
            if torch.distributed.get_rank() == 0:
                r = rounds[variant][-1]
                print(f"round {round_index + 1}/{args.repeats} {variant:>16}: "
                      f"{r['median_s']:.4f} s  {r['peak_gib']:.2f} GiB", flush=True)  # fmt: skip
                # after every variant, so a cut-off run keeps its figures
                _write(args, ep, results, commands)
    if torch.distributed.get_rank() == 0:
        for key, value in summarize(results).items():
            if value is not None:
                print(f"{key}: {value:.3f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Step time, memory and model FLOP utilisation (MFU) of ``train``'s own training step.

    python benchmarks/mfu.py --out benchmarks/results [--quick] [--shape issue|large]
    torchrun --nproc_per_node 4 benchmarks/mfu.py --out OUT --quick --ep 4 [--overlap]
    python benchmarks/mfu.py --out /tmp/mfu --shape tiny          # CPU check of the script

Each run is a pattern built by one implementation and trained exactly as ``python -m
megatron_hybrid train`` trains it, with that command's own pieces: its flags (parsed by its
parser; the shape's sizes, ``--swiglu --bf16 --disable-bias-linear``), its config, its model
chunks in megatron's DistributedDataParallel, its optimizer (the distributed optimizer on GPUs,
with clipping), its step function (``training.loop.train_step``: the schedule, gradient
finalisation, the non-finite guard, the update) and its data (the synthetic variable-length
sequences ``train`` feeds, padded or ``--packed`` as ``train`` lays them out; ``--data full``
makes every sequence ``--seq-length`` long, ``--data documents`` runs ``train
--synthetic-samples documents``: full rows of several documents, as real data comes). So the
benchmark measures the product and cannot drift from it. ``--host-profile N`` runs one more step
under cProfile and lists the N Python functions with the most own time.

Per run: the median step over ``--steps`` steps after ``--warmup`` (the first step, which
compiles and autotunes, reported on its own; each step builds the next one's micro-batches while
the device runs it, as ``train``'s loop does, and its time counts them), real tokens per second,
peak allocated memory, TFLOP/s per GPU and MFU (``training.throughput``: the step's model FLOPs
over its real tokens, from the per-layer-type formulas, over the GPU's dense bf16 peak), where
one step's time goes by phase (``training.phases``: data, forward-backward, gradient
finalisation, guard, optimizer, host; an extra step with device waits around each phase), and
from one profiled step the GPU's busy fraction, kernels per step and a per-kernel breakdown
(``trace_summary.py``). Under torchrun these are rank 0's, and a table gives every rank's own
steps, phases, its experts' rows and, from its profiled step, GPU compute, NCCL and host-wait
times: at EP > 1 the ranks wait for each other in the all-to-alls, and the rank the others wait
for waits least.

Patterns (``--patterns``): ``star_e`` ``[*E]{L}``, ``ge`` ``[GE]{L}``, ``me`` ``[ME]{L}``,
``plus_e`` ``[+E]{L}``. Implementations: ``fast`` (``train``'s default: the ``local`` backend's
fast TE-free path on GPUs), ``fast-graphs`` (``--hybrid-cuda-graphs``), ``reference`` (the
``local`` backend's megatron-core modules, for comparison), ``te`` (``--transformer-impl
transformer_engine --moe-grouped-gemm``; skipped where TransformerEngine is not importable).
Runs go one after another in one process; each frees its model, optimizer and megatron state.

Shapes: ``issue`` (hidden 2048, 16 heads, 64 experts top-8 of hidden 512, sequence 4096, 4
logical layers, 8 micro-batches of 1 per data-parallel rank), ``large`` (hidden 4096, 32 heads,
64 experts top-8 of hidden 1024, sequence 8192), ``tiny`` (a CPU check). Writes
``mfu_<shape>_<device>[_<N>gpu][_<data>][_packed][_overlap][_tf32].{json,md}`` into ``--out``
(rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from common import host_cpu, host_profile, recorded_command, sync
from step_events import StepEvents, event_lines
from trace_summary import profile_call

from megatron_hybrid.training.param_order import EXPERTS_ORDER, ORDERS

CUDA = torch.cuda.is_available()

PATTERNS = {"star_e": "[*E]", "ge": "[GE]", "me": "[ME]", "plus_e": "[+E]"}
IMPLS = ("fast", "fast-graphs", "reference", "te")
DATA = ("variable", "full", "documents")

SHAPES = {
    "issue": dict(layers=4, hidden=2048, heads=16, experts=64, topk=8, expert_hidden=512,
                  seq=4096, mbs=1, microbatches=8, vocab=32768, mamba_state=128,
                  mamba_head_dim=64, mamba_groups=8, q_lora_rank=None, kv_lora_rank=512,
                  qk_head_dim=128, qk_rope_dim=64, v_head_dim=128),
    "large": dict(layers=4, hidden=4096, heads=32, experts=64, topk=8, expert_hidden=1024,
                  seq=8192, mbs=1, microbatches=8, vocab=32768, mamba_state=128,
                  mamba_head_dim=64, mamba_groups=8, q_lora_rank=1536, kv_lora_rank=512,
                  qk_head_dim=128, qk_rope_dim=64, v_head_dim=128),
    "tiny": dict(layers=2, hidden=64, heads=4, experts=8, topk=2, expert_hidden=32, seq=64,
                 mbs=1, microbatches=2, vocab=256, mamba_state=16, mamba_head_dim=16,
                 mamba_groups=2, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16,
                 qk_rope_dim=8, v_head_dim=16),
}  # fmt: skip

#: The issue's MFU targets per pattern, through train's step: its default (``fast``) or with
#: ``--hybrid-cuda-graphs`` (``fast-graphs``), whichever was measured faster.
TARGETS = (("star_e", 0.30), ("ge", 0.20), ("me", 0.20), ("plus_e", 0.20))
TARGET_IMPLS = ("fast", "fast-graphs")


def target_rows(results: dict) -> list[tuple[str, float | None, float]]:
    """``(label, MFU or None, bound)`` per target: the best measured of :data:`TARGET_IMPLS`,
    named in the label."""
    rows = []
    for name, bound in TARGETS:
        measured = {i: _get(results, f"{name}/{i}", "mfu") for i in TARGET_IMPLS}
        measured = {i: v for i, v in measured.items() if v is not None}
        best = max(measured, key=measured.get) if measured else None
        label = f"{name} MFU >= {bound:.2f} ({best or ' or '.join(TARGET_IMPLS)})"
        rows.append((label, measured.get(best), bound))
    return rows


def te_available() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def train_flags(shape: SimpleNamespace, name: str, impl: str, args) -> list[str]:
    """``train``'s command-line flags for one run (the shape's sizes, bf16, SwiGLU)."""
    world = torch.distributed.get_world_size()
    flags = [
        "--hybrid-layer-pattern", f"{PATTERNS[name]}{{{shape.layers}}}",
        "--hidden-size", shape.hidden, "--num-attention-heads", shape.heads,
        "--swiglu", "--disable-bias-linear",
        "--num-experts", shape.experts, "--moe-router-topk", shape.topk,
        "--moe-ffn-hidden-size", shape.expert_hidden,
        "--moe-token-dispatcher-type", "alltoall",
        "--mamba-state-dim", shape.mamba_state, "--mamba-head-dim", shape.mamba_head_dim,
        "--mamba-num-groups", shape.mamba_groups,
        "--kv-lora-rank", shape.kv_lora_rank, "--qk-head-dim", shape.qk_head_dim,
        "--qk-pos-emb-head-dim", shape.qk_rope_dim, "--v-head-dim", shape.v_head_dim,
        "--seq-length", shape.seq, "--micro-batch-size", shape.mbs,
        "--global-batch-size", shape.mbs * shape.microbatches * world,
        "--vocab-size", shape.vocab,
        "--expert-model-parallel-size", args.ep,
        "--train-iters", args.warmup + args.steps + 2,
    ]  # fmt: skip
    if shape.q_lora_rank:
        flags += ["--q-lora-rank", shape.q_lora_rank]
    if CUDA:
        flags.append("--bf16")
    if impl == "fast-graphs":
        flags.append("--hybrid-cuda-graphs")
    if impl == "te":
        flags += ["--transformer-impl", "transformer_engine", "--moe-grouped-gemm"]
    if args.packed:
        flags.append("--packed")
    if args.overlap:
        flags.append("--overlap-moe-expert-parallel-comm")
    if args.manual_gc:
        flags.append("--manual-gc")
    if args.moe_router_force_load_balancing and "E" in PATTERNS[name]:
        flags.append("--moe-router-force-load-balancing")
    if not args.gradient_accumulation_fusion:
        flags.append("--no-gradient-accumulation-fusion")
    if args.data == "documents":
        flags += ["--synthetic-samples", "documents"]
    return [str(flag) for flag in flags]


def train_args(flags: list[str]):
    """``flags`` parsed by ``train``'s own parser, as ``train``'s typed settings with the
    run-dependent defaults filled in as ``train`` fills them (a run from scratch on the synthetic
    data)."""
    from megatron_hybrid.cli.train import COMMAND
    from megatron_hybrid.training.inputs import resolve_data
    from megatron_hybrid.training.schedule import resolve_schedule
    from megatron_hybrid.training.train_settings import settings_from_args

    parser = argparse.ArgumentParser()
    COMMAND.configure(parser)
    args = resolve_data(settings_from_args(parser.parse_args(flags)))
    return resolve_schedule(args, fine_tuning=False, lora=False)


def gdn_torch_scan(args) -> bool:
    """Whether ``G`` runs the fast path's torch scan (``--gdn-kernel torch``) instead of what
    ``train`` runs (fla's kernels)."""
    return args.gdn_kernel == "torch"


class Run:
    """One run's model, optimizer and data, built by ``train``'s own functions."""

    def __init__(self, args, shape, name: str, impl: str):
        from megatron_hybrid.pattern import parse_pattern
        from megatron_hybrid.runtime import select_backend
        from megatron_hybrid.training import run as train_run
        from megatron_hybrid.training.inputs import RunInputs
        from megatron_hybrid.training.loop import build_model_chunks
        from megatron_hybrid.training.optimizers import build_optimizer
        from megatron_hybrid.training.throughput import StepFlops
        from megatron_hybrid.training.validation import SCOPES, validate_settings

        self.args = train_args(train_flags(shape, name, impl, args))
        targs = self.args
        scan = "G" in PATTERNS[name] and gdn_torch_scan(args)
        # The torch scan is the benchmark's own choice (deterministic_mode), not train's path:
        # train's device rule about fla's kernels does not apply to it.
        validate_settings(targs, scopes=tuple(s for s in SCOPES if s != "device" or not scan))
        if "G" in PATTERNS[name] and CUDA:
            os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # as train sets it
        self.backend = select_backend()
        self.config = train_run.model_config(targs, None, self.backend)  # train's config
        if scan:
            self.config.deterministic_mode = True
        world = torch.distributed.get_world_size()
        self.rank = torch.distributed.get_rank()
        self.pg, _, self.num_microbatches = train_run.parallel_setup(targs, self.config, world)
        self.parsed = parse_pattern(targs.hybrid_layer_pattern)
        global_batch = targs.global_batch_size
        self.inputs = RunInputs(targs, self.config, self.pg, self.parsed,
                                global_batch=global_batch, device=self.backend.device(),
                                on_gpu=self.backend.on_gpu)  # fmt: skip
        self.inputs.open(consumed=0, start=0, evaluate=False)
        self.seq_length = self.inputs.seq_length
        if args.data == "full":  # every sequence --seq-length long: one shape for every batch
            import dataclasses

            tokens = self.inputs.train.tokens
            self.inputs.train = dataclasses.replace(
                self.inputs.train, tokens=dataclasses.replace(tokens, min_length=tokens.max_length)
            )
        # train builds the fast path on GPUs and the reference path on the CPU; the CPU check
        # builds what the run names.
        local_impl = "reference" if impl == "reference" else "fast" if not CUDA else None
        if local_impl is not None and impl != "te":
            from megatron_hybrid.modules import hybrid_stack_spec

            spec = hybrid_stack_spec(
                "local", config=self.config, mamba_impl=targs.mamba_impl, local_impl=local_impl
            )
            self.chunks = build_model_chunks(
                self.config, self.parsed, self.pg, backend="local", stack_spec=spec,
                vocab_size=targs.vocab_size, max_sequence_length=self.seq_length,
                mamba_impl=targs.mamba_impl, param_order=args.param_order,
            )  # fmt: skip
        else:
            self.chunks = train_run.build_chunks(
                targs, self.config, self.pg, self.parsed, None, self.seq_length, self.rank,
                param_order=args.param_order,
            )  # fmt: skip
        self.optimizer = build_optimizer(
            self.chunks, self.config, lr=targs.lr, weight_decay=targs.weight_decay,
            clip_grad=targs.clip_grad, pg=self.pg,
        )  # fmt: skip
        self.flops = StepFlops(self.config, self.parsed, targs.vocab_size)
        self.consumed = 0

    def batches(self) -> list[dict]:
        """The next step's micro-batches of this rank, as ``train`` builds them."""
        first = self.consumed
        self.consumed += self.args.global_batch_size
        return self.flops.annotate(
            self.inputs.micro_batches(self.inputs.train, first, self.num_microbatches)
        )

    def step(self, batches, timer=None, upcoming: list | None = None):
        """``train``'s step on ``batches``; given ``upcoming``, it builds the next step's
        micro-batches into it while the device runs, as ``train`` does."""
        from megatron_hybrid.training.loop import train_step

        seq_length, rows = self.inputs.step_shape
        prefetch = None if upcoming is None else lambda: upcoming.append(self.batches())
        return train_step(
            self.chunks, self.optimizer, batches, self.config, seq_length=seq_length,
            micro_batch_size=rows, pg_collection=self.pg, timer=timer, while_queued=prefetch,
        )  # fmt: skip

    def close(self) -> None:
        """Free the model, the optimizer and megatron's state (the next run starts clean)."""
        from megatron_hybrid.process_groups import reset_megatron_state

        self.chunks = self.optimizer = self.inputs = None
        reset_megatron_state()
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()


def profile(step) -> tuple[dict, dict, list[dict]]:
    """One step under torch.profiler: its summary, kernel breakdown and the host's operators
    with the most own time."""
    return profile_call(step, sync, top=25)


@contextlib.contextmanager
def counting_expert_rows(chunks):
    """Counts, while open, the rows this rank's routed experts take: their input's rows, every
    MoE layer and micro-batch. At EP > 1 that is what the all-to-alls brought, and the ranks'
    counts say how evenly the routing loads them (a rank given more rows keeps the others
    waiting). Experts replayed in a CUDA graph are not called, and count nothing."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.utils import unwrap_model

    counted = SimpleNamespace(rows=0)

    def count(module, args):
        counted.rows += args[0].shape[0]

    handles = [module.experts.register_forward_pre_hook(count)
               for chunk in unwrap_model(chunks) for module in chunk.modules()
               if isinstance(module, MoELayer)]  # fmt: skip
    try:
        yield counted
    finally:
        for handle in handles:
            handle.remove()


#: A rank's own figures from its profiled step (``trace_summary.summarise``'s keys), beside its
#: timed steps and phases in the per-rank table of a run with several processes.
RANK_PROFILE_KEYS = ("compute_busy_ms", "comm_busy_ms", "cpu_sync_wait_ms", "cpu_outside_ms")


def per_rank(result: dict) -> list[dict] | None:
    """Every rank's own figures, gathered on each (None in a one-process run): its timed steps,
    its phase-timed step and, where it profiled one, how long its GPU computed, how long NCCL's
    kernels were resident and how long its host waited on the device. The run's own figures
    are rank 0's; at EP > 1 the ranks wait for each other in the all-to-alls, and the one the
    others wait for is the one that waits least. Every rank calls it at the same point."""
    world = torch.distributed.get_world_size()
    if world == 1:
        return None
    profiled = result.get("profile") or {}
    mine = {
        "rank": torch.distributed.get_rank(),
        "steps_s": result["steps_s"],
        "step_events": result["step_events"],
        "phases_ms": result["phases_ms"],
        "expert_rows": result["expert_rows"],
        **{key: profiled.get(key) for key in RANK_PROFILE_KEYS},
    }
    ranks: list = [None] * world
    torch.distributed.all_gather_object(ranks, mine)
    return ranks


def measure(args, shape, name: str, impl: str, peak) -> dict:
    """One run: build, warm up, time, time by phase, profile; freed afterwards."""
    from megatron_hybrid.modules.fast.compiled import COMPILE_SECONDS

    compiled_before = dict(COMPILE_SECONDS)
    run = Run(args, shape, name, impl)
    try:
        result = _measure(args, run, impl, peak)
    finally:
        run.close()
    result["compile_s"] = {k: v - compiled_before.get(k, 0.0) for k, v in COMPILE_SECONDS.items()
                           if v != compiled_before.get(k, 0.0)}  # fmt: skip
    return result


def _measure(args, run: Run, impl: str, peak) -> dict:
    """:func:`_steps` under ``train``'s ``--manual-gc`` as ``train`` applies it (the collector
    off around every step, the timed, phase-timed and profiled ones)."""
    from megatron_hybrid.training.collection import ManualCollection

    targs = run.args
    with ManualCollection(targs.manual_gc, targs.manual_gc_interval, False) as collector:
        return _steps(args, run, impl, peak, collector)


def _steps(args, run: Run, impl: str, peak, collector) -> dict:
    from megatron.core.utils import unwrap_model

    from megatron_hybrid.modules.fast import fast_path_report
    from megatron_hybrid.training.phases import PhaseTimer
    from megatron_hybrid.training.throughput import tflops_per_gpu, throughput_text

    world = torch.distributed.get_world_size()
    warmup, steps = args.warmup, args.steps
    if args.quick and impl == "reference":  # seconds per step at the issue's shape
        warmup, steps = 1, 2
    times, flops, tokens, first, events = [], [], [], None, []
    # As train: each step builds the next one's micro-batches while the device runs it, and
    # its time counts them.
    batches = run.batches()
    with StepEvents() as counting:
        for index in range(warmup + steps):
            if index == warmup and CUDA:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            upcoming = []
            sync()
            counting.mark()
            began = time.perf_counter()
            result = run.step(batches, upcoming=upcoming)
            sync()
            elapsed = time.perf_counter() - began
            step_events = counting.mark()
            (batches,) = upcoming
            if index == 0:
                first = elapsed
            if index >= warmup:
                times.append(elapsed)
                flops.append(result.flops)
                tokens.append(result.tokens)
                events.append(step_events)
            collector.after_step(index + 1)
    median = statistics.median(times)
    rate = tflops_per_gpu(flops, times, world)
    # One more step with a wait around each phase: where the step's time goes.
    timer = PhaseTimer(run.backend.synchronize)
    # Its data phase: the next step's micro-batches, built inside it.
    with counting_expert_rows(run.chunks) as counted, timer.step():
        run.step(batches, timer=timer, upcoming=[])
    result = {
        "pattern": run.args.hybrid_layer_pattern,
        "impl": impl,
        "median_s": median,
        "steps_s": times,
        "step_events": events,
        "first_step_s": first,
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times, strict=True)),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0,
        "step_tflop": statistics.median(flops) / 1e12,
        "tflops_per_gpu": rate,
        "mfu": rate / peak.tflops if rate is not None and peak is not None else None,
        "throughput": throughput_text(rate, peak),
        "phases_ms": {k: 1e3 * v for k, v in timer.breakdown().items()},
        "phases_step_ms": 1e3 * timer.step_seconds,
        "expert_rows": counted.rows or None,
        "gdn_kernel": _gdn_label(run) if "G" in run.args.hybrid_layer_pattern else None,
    }
    inner = unwrap_model(run.chunks)
    report = {}
    for chunk in inner:
        report.update(fast_path_report(chunk))
        for name, module in chunk.named_modules():  # e.g. the Mamba scan's TF32 products
            detail = getattr(module, "fast_path_detail", None)
            if detail is not None and report.get(name) == "fast":
                report[name] = f"fast ({detail})"
    # The fused loss (on GPUs) runs on the last pipeline stage's chunk, in
    # HybridModel.compute_language_model_loss.
    loss_path = getattr(inner[-1], "cross_entropy_path", None)
    if loss_path is not None and inner[-1].config.cross_entropy_loss_fusion:
        report["cross_entropy"] = "fast" if loss_path == "Triton" else loss_path
    if report:
        result["fast_path"] = sorted({f"{k.split('.')[-1]}: {v}" for k, v in report.items()})
    graphs = getattr(inner[0], "hybrid_cuda_graphs", None)
    if graphs is not None:
        result["cuda_graphs"] = graphs.summary().splitlines()
    if CUDA and not args.no_profile:
        batches = run.batches()
        summary, breakdown, host_ops = profile(lambda: run.step(batches, upcoming=[]))
        window = summary["window_ms"]
        matmul_ms = sum(breakdown["categories"].get(c, {}).get("ms", 0.0)
                        for c in ("gemm", "attention"))  # fmt: skip
        ideal_ms = statistics.median(flops) / world / (peak.tflops * 1e12) * 1e3 if peak else None
        result.update(
            profile=summary,
            kernels=breakdown,
            host_ops=host_ops,
            gpu_busy=summary["gpu_busy_ms"] / window,
            kernels_per_step=summary["compute_kernels"] + summary["nccl_kernels"],
            distance={
                "ideal_ms": ideal_ms,
                "profiled_step_ms": window,
                "gpu_idle_ms": summary["gpu_idle_ms"],
                "matmul_kernels_ms": matmul_ms,
                "other_kernels_ms": summary["compute_kernel_sum_ms"] - matmul_ms,
                "matmul_efficiency": ideal_ms / matmul_ms if matmul_ms and ideal_ms else None,
            },
        )
    ranks = per_rank(result)
    if ranks is not None:
        result["ranks"] = ranks
    if args.host_profile:
        from host_breakdown import module_host_times, module_operators

        batches = run.batches()
        result["host_profile"] = host_profile(lambda: run.step(batches), args.host_profile)
        # The forward's host time and operators per module class (hooks: forward only).
        batches = run.batches()
        hooked_ms, times = module_host_times(run.chunks, lambda: run.step(batches))
        batches = run.batches()
        operators, _ = module_operators(run.chunks, lambda: run.step(batches))
        top = args.host_profile
        result["host_profile"].update(
            hooked_ms=hooked_ms, modules=times[:top], operators=operators[:top]
        )
    return result


def _gdn_label(run) -> str:
    """What GatedDeltaNet ran: fla's kernels, the fast path's scan or megatron's torch loop."""
    from megatron.core.utils import unwrap_model

    for module in unwrap_model(run.chunks)[0].modules():
        kernel = getattr(module, "gdn_kernel", None)
        if kernel is not None:
            return {"scan": "torch scan"}.get(kernel, kernel)
    return "torch loop" if run.config.deterministic_mode else "fla"


def _fmt(value, spec=".3f") -> str:
    return "—" if value is None else format(value, spec)


def result_stem(args, shape_name: str, device: str) -> str:
    """The results' file name without suffix."""
    world = torch.distributed.get_world_size()
    parts = [f"mfu_{shape_name}_{device.replace(' ', '-')}"]
    if world > 1:
        parts.append(f"{world}gpu")
    if args.data != "variable":
        parts.append(args.data)
    parts += [s for s, on in (("packed", args.packed), ("overlap", args.overlap),
                              ("tf32", args.tf32), ("manualgc", args.manual_gc),
                              ("balanced", args.moe_router_force_load_balancing),
                              (f"{args.param_order}order", args.param_order != EXPERTS_ORDER),
                              ("nowgradfusion", not args.gradient_accumulation_fusion))
              if on]  # fmt: skip
    return "_".join(parts)


def write(args, shape_name: str, meta: dict, results: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(args, shape_name, meta["device"])
    targets = target_rows(results)
    checked = [dict(target=t, value=v, bound=b, met=_met(v, b)) for t, v, b in targets]
    (out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "results": results, "targets": checked}, indent=1)
    )
    peak = meta["peak_tflops"]
    lines = [
        f"# MFU of train's step, shape `{shape_name}`, {meta['device']}", "",
        f"{meta['date']}; torch {meta['torch']}; "
        + (f"peak {peak:.0f} TFLOP/s ({meta['peak_source']})" if peak else "no peak")
        + f"; {meta['setup']}; host {meta['host']}.", "", f"`{meta['command']}`", "",
        "| run | step s | first step s | tokens/s | peak GiB | step TFLOP | TFLOP/s/GPU | MFU "
        "| GPU busy | kernels / step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for run, r in results.items():
        label = run if not r.get("gdn_kernel") else f"{run} ({r['gdn_kernel']})"
        lines.append(
            f"| {label} | {r['median_s']:.4f} | {r['first_step_s']:.2f} | {r['tokens_per_s']:,.0f} "
            f"| {r['peak_gib']:.2f} | {r['step_tflop']:.2f} | {_fmt(r['tflops_per_gpu'], '.1f')} "
            f"| {_fmt(r['mfu'], '.4f')} | {_fmt(r.get('gpu_busy'))} "
            f"| {r.get('kernels_per_step', '—')} |"
        )
    lines += ["", "| target | value | met |", "| --- | ---: | --- |"]
    for label, value, bound in targets:
        lines.append(f"| {label} | {_fmt(value, '.4f')} | {_met(value, bound)} |")
    names = list(dict.fromkeys(k for r in results.values() for k in r["phases_ms"]))
    lines += ["", "Where a step's time goes (ms; one step with a device wait around each phase; "
              "`host`: the rest of the step):", "",
              "| run | " + " | ".join(names) + " | step |",
              "| --- |" + " ---: |" * (len(names) + 1)]  # fmt: skip
    for run, r in results.items():
        cells = [_fmt(r["phases_ms"].get(k), ".1f") for k in names]
        lines.append(f"| {run} | " + " | ".join(cells) + f" | {r['phases_step_ms']:.1f} |")
    lines += rank_lines(results)
    lines += event_lines(results)
    for run, r in results.items():
        if not ({"distance", "fast_path", "cuda_graphs", "host_profile", "host_ops"} & set(r)
                or r.get("compile_s")):  # fmt: skip
            continue
        lines += ["", f"## {run}", ""]
        if "distance" in r:
            d = r["distance"]
            lines.append(
                f"Profiled step {d['profiled_step_ms']:.1f} ms against {_fmt(d['ideal_ms'], '.1f')}"
                f" ms at peak: GPU idle {d['gpu_idle_ms']:.1f} ms, non-matmul kernels "
                f"{d['other_kernels_ms']:.1f} ms, matmul and attention kernels "
                f"{d['matmul_kernels_ms']:.1f} ms (at {_fmt(d['matmul_efficiency'], '.2f')} of "
                "peak on the counted FLOPs)."
            )
            lines += ["", "| category | ms | kernels |", "| --- | ---: | ---: |"]
            for category, c in r["kernels"]["categories"].items():
                lines.append(f"| {category} | {c['ms']:.1f} | {c['count']} |")
            lines += ["", "| kernel | category | ms | count | mean µs |",
                      "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
            for k in r["kernels"]["kernels"]:
                name = k["name"].replace("|", "/")
                lines.append(f"| `{name}` | {k['category']} | {k['ms']:.1f} | {k['count']} "
                             f"| {k['mean_us']:.1f} |")  # fmt: skip
        if r.get("compile_s"):
            lines += ["", "Compiled pieces (first call per shape, s): " + ", ".join(
                f"{k} {v:.1f}" for k, v in r["compile_s"].items())]  # fmt: skip
        if r.get("fast_path"):
            lines += ["", "Fast modules: " + "; ".join(r["fast_path"])]
        if r.get("cuda_graphs"):
            lines += ["", "CUDA graphs:", "", *(f"* {line}" for line in r["cuda_graphs"])]
        if r.get("host_profile"):
            h = r["host_profile"]
            lines += [
                "",
                f"Host (cProfile, one step of {h['step_ms']:.1f} ms, "
                f"{h['function_calls']:,} Python function calls):",
                "",
                "| function | calls | own ms | cumulative ms |",
                "| --- | ---: | ---: | ---: |",
            ]
            lines += [f"| `{f['function']}` | {f['calls']} | {f['own_ms']:.1f} "
                      f"| {f['cumulative_ms']:.1f} |" for f in h["top"]]  # fmt: skip
            lines += ["", f"Forward host time per module class (hooked step {h['hooked_ms']:.1f} "
                      "ms), and torch operators:", "", "| module | own ms | calls |",
                      "| --- | ---: | ---: |"]  # fmt: skip
            lines += [f"| {m['module']} | {m['self_ms']:.1f} | {m['calls']} |"
                      for m in h["modules"]]  # fmt: skip
            lines += ["", "| module | operators |", "| --- | ---: |"]
            lines += [f"| {m['module']} | {m['ops']} |" for m in h["operators"]]
        if r.get("host_ops"):
            lines += [
                "",
                "Host operators (profiled step, own time):",
                "",
                "| operator | own ms | count |",
                "| --- | ---: | ---: |",
            ]
            lines += [f"| `{o['name'][:80]}` | {o['self_cpu_ms']:.1f} | {o['count']} |"
                      for o in r["host_ops"]]  # fmt: skip
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: 8 + len(results) + 3 + len(targets)]), flush=True)


def rank_lines(results: dict) -> list[str]:
    """The per-rank table of the runs with several processes (:func:`per_rank`), or nothing."""
    rows = [(run, rank) for run, r in results.items() for rank in r.get("ranks") or ()]
    if not rows:
        return []
    lines = ["", "Each rank's own steps (the run's figures are rank 0's; ms and its experts' "
             "rows from its phase-timed step, the rest from its profiled step; the rank the "
             "others wait for waits least on the device):",
             "", "| run | rank | median step s | slowest step s | forward-backward ms | host ms "
             "| expert rows | GPU computing ms | NCCL kernels ms | host waits on device ms "
             "| host outside operators ms |",
             "| --- |" + " ---: |" * 10]  # fmt: skip
    for run, rank in rows:
        phases = rank["phases_ms"]
        lines.append(
            f"| {run} | {rank['rank']} | {statistics.median(rank['steps_s']):.4f} "
            f"| {max(rank['steps_s']):.4f} | {_fmt(phases.get('forward-backward'), '.1f')} "
            f"| {_fmt(phases.get('host'), '.1f')} | {_fmt(rank['expert_rows'], ',')} "
            f"| {_fmt(rank['compute_busy_ms'], '.1f')} "
            f"| {_fmt(rank['comm_busy_ms'], '.1f')} | {_fmt(rank['cpu_sync_wait_ms'], '.1f')} "
            f"| {_fmt(rank['cpu_outside_ms'], '.1f')} |"
        )
    return lines


def _get(results, run, key):
    return results.get(run, {}).get(key)


def _met(value, bound) -> str:
    if value is None:
        return "not measured"
    return "met" if value >= bound else "**not met**"


def default_runs(te: bool) -> list[tuple[str, str]]:
    runs = [(name, "fast") for name in PATTERNS] + [("star_e", "reference")]
    if te:
        runs += [(name, "te") for name in PATTERNS]
    return runs + [("star_e", "fast-graphs")]


def parse_runs(parser, values: list[str] | None, te: bool) -> list[tuple[str, str]]:
    if not values:
        return default_runs(te)
    runs = []
    for value in values:
        name, _, impl = value.partition("/")
        if name not in PATTERNS or impl not in IMPLS:
            parser.error(f"--runs {value!r}: expected PATTERN/IMPL with PATTERN in "
                         f"{sorted(PATTERNS)} and IMPL in {list(IMPLS)}")  # fmt: skip
        runs.append((name, impl))
    return runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="issue" if CUDA else "tiny")
    parser.add_argument("--runs", nargs="+", metavar="PATTERN/IMPL",
                        help="runs to measure, e.g. star_e/fast ge/te (default: every pattern "
                        "fast, star_e reference, where TE is importable every pattern te, then "
                        "star_e fast-graphs)")  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true", help="2 warm-up and 4 timed steps (reference runs: 1 and 2)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--data", choices=DATA, default="variable",
                        help="train's synthetic variable-length sequences (default), every "
                        "sequence --seq-length long (full), or train --synthetic-samples "
                        "documents: samples of --seq-length tokens of whole sequences back "
                        "to back, as megatron-core's GPTDataset cuts real data "
                        "(documents)")  # fmt: skip
    parser.add_argument("--packed", action="store_true", help="train --packed (THD rows)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (under torchrun)")
    parser.add_argument("--overlap", action="store_true",
                        help="train --overlap-moe-expert-parallel-comm")  # fmt: skip
    parser.add_argument(
        "--manual-gc",
        action="store_true",
        help="train --manual-gc (no automatic garbage collection in the steps)",
    )
    parser.add_argument(
        "--moe-router-force-load-balancing",
        action="store_true",
        help="train's flag for MoE runs: random router logits, every expert about equally "
        "loaded, as a trained router's (the benchmarks of Megatron-Bridge's performance "
        "cards use it); default: the untrained router's routing",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="one more step under cProfile: the N Python functions with the "
                        "most own time (where the host's time goes; a device wait shows as the "
                        "call that waits)")  # fmt: skip
    parser.add_argument("--tf32", action="store_true",
                        help="let float32 matmuls use TF32 tensor cores (torch.backends.cuda."
                        "matmul.allow_tf32); recorded in the results")  # fmt: skip
    parser.add_argument("--gdn-kernel", choices=("auto", "torch"), default="auto",
                        help="GatedDeltaNet: what train runs (fla's kernels; default), or the "
                        "fast path's torch scan (deterministic_mode)")  # fmt: skip
    parser.add_argument("--param-order", choices=ORDERS, default=EXPERTS_ORDER,
                        help="the DDP buffers' parameter order (training/param_order.py): "
                        "the routed experts' weights in expert order, as train builds them "
                        "(default), or megatron-core's own, which the grouped GEMM copies "
                        "(the layout before it)")  # fmt: skip
    parser.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                        dest="gradient_accumulation_fusion",
                        help="train's flag: DDP's hook adds each local linear's bfloat16 weight "
                        "gradient into main_grad (the path before the fusion)")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's peak in TFLOP/s (default: from its name, as train; "
                        "MEGATRON_HYBRID_PEAK_TFLOPS works too)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> None:
    from megatron_hybrid.runtime import prefer_expandable_segments

    prefer_expandable_segments()  # as train does, before CUDA starts
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.steps = 2, 4
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    if args.peak_tflops is not None:
        if args.peak_tflops <= 0:
            parser.error("--peak-tflops must be positive")
        os.environ["MEGATRON_HYBRID_PEAK_TFLOPS"] = str(args.peak_tflops)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    te = te_available()
    runs = parse_runs(parser, args.runs, te)
    skipped = [f"{n}/{i}" for n, i in runs if i == "te" and not te]
    runs = [(n, i) for n, i in runs if f"{n}/{i}" not in skipped]

    from megatron_hybrid.process_groups import init_world
    from megatron_hybrid.runtime import select_backend
    from megatron_hybrid.training.throughput import device_peak

    backend = select_backend()
    backend.activate()  # on a CPU: megatron-core's CUDA calls emulated (numbers meaningless)
    rank, world = init_world()
    if world % args.ep:
        parser.error(f"--ep {args.ep} must divide the {world} processes")
    device = backend.device_name()
    peak = device_peak(device if CUDA else None)
    if skipped and rank == 0:
        print(f"skipped (TransformerEngine not importable): {', '.join(skipped)}")
    shape = SimpleNamespace(**SHAPES[args.shape])
    meta = dict(
        device=device,
        host=host_cpu(),
        gpus=world if CUDA else 0,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        command=recorded_command("mfu.py", sys.argv[1:] if argv is None else argv),
        peak_tflops=peak.tflops if peak else None,
        peak_source=peak.source if peak else None,
        shape={"name": args.shape, **SHAPES[args.shape]},
        cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        setup=(f"train's step; hidden {shape.hidden}, {shape.heads} heads, {shape.experts} "
               f"experts top-{shape.topk} (hidden {shape.expert_hidden}), seq {shape.seq}, "
               f"{shape.layers} logical layers, {shape.microbatches} micro-batches of "
               f"{shape.mbs} per data-parallel rank, vocab {shape.vocab}, "
               + ("bf16" if CUDA else "float32") + ", SwiGLU, "
               + f"{args.data} lengths" + (", packed" if args.packed else ", padded")
               + f", {world} process{'es' if world > 1 else ''}, EP {args.ep}"
               + (", EP overlap" if args.overlap else "")
               + (", TF32 float32 matmuls" if args.tf32 else "")
               + (", --manual-gc" if args.manual_gc else "")
               + (", routing forced balanced" if args.moe_router_force_load_balancing else "")
               + f", DDP buffers in the {args.param_order} parameter order"
               + ("" if args.gradient_accumulation_fusion
                  else ", no weight-gradient accumulation fusion")),
        skipped=skipped,
    )  # fmt: skip
    results: dict = {}
    for name, impl in runs:
        run = f"{name}/{impl}"
        if rank == 0:
            print(f"== {run}", flush=True)
        results[run] = measure(args, shape, name, impl, peak)
        r = results[run]
        if rank == 0:
            print(f"   {r['median_s']:.4f} s/step, first {r['first_step_s']:.2f} s, "
                  f"{r['tokens_per_s']:,.0f} tokens/s, {r['peak_gib']:.2f} GiB, "
                  f"{r['throughput'] or 'no TFLOP/s on a CPU'}, GPU busy "
                  f"{_fmt(r.get('gpu_busy'))}", flush=True)  # fmt: skip
            # Every timed step: a median hides steps that pay work others do not (EP4, 4 x H200:
            # 0.60, 1.86, 0.88 and 1.94 s).
            print("   steps s: " + ", ".join(f"{t:.3f}" for t in r["steps_s"]), flush=True)
            write(args, args.shape, meta, results)  # after every run: a cut-off job keeps figures
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

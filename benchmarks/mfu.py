"""Step time, memory and model FLOP utilisation (MFU) of hybrid stacks on one GPU.

    python benchmarks/mfu.py --out benchmarks/results [--quick] [--shape issue|large]
    python benchmarks/mfu.py --out /tmp/mfu --shape tiny          # CPU check of the script

Per run (a pattern built by one implementation) it measures the median step time over
``--steps`` steps after ``--warmup`` (the first warm-up step, which compiles and autotunes, is
reported on its own), tokens per second, peak allocated memory and MFU: the model FLOPs of a
step (``megatron_hybrid.modules.flops``: matrix products of the forward pass, causal attention
counted as such, times three) over the step time and the GPU's dense bf16 peak. One more step
runs under torch.profiler: the fraction of the step the GPU is busy, kernels per step and a
per-kernel breakdown (``trace_summary.py``), so the distance to the limit can be assigned to
idle time, non-matmul kernels and matmul efficiency.

Patterns (``--patterns``): ``star_e`` ``[*E]{L}``, ``ge`` ``[GE]{L}``, ``me`` ``[ME]{L}``,
``plus_e`` ``[+E]{L}``. Implementations: ``fast`` (``local`` backend, fast TE-free path),
``fast-graphs`` (the same with the package's CUDA graphs of the layers' compute pieces),
``reference`` (``local`` backend, megatron-core's modules), ``te`` (the ``te`` spec, grouped-GEMM
experts), ``gpt-te`` / ``gpt-local`` (GPTModel with the same layers; ``*`` and ``+`` only).
TE runs are skipped where TransformerEngine is not importable. Every run uses the same
settings: bf16, SwiGLU (the activation GatedDeltaNet needs, so the FLOPs match between
patterns), megatron's fused weighted SwiGLU and native fused cross-entropy, alltoall dispatcher,
no auxiliary loss, the plain schedule over ``--microbatches`` micro-batches, and gradients as
``train`` accumulates them: megatron's ``DistributedDataParallel`` with float32 ``main_grad``
buffers in the distributed optimizer's layout (``--no-ddp``: plain autograd ``.grad``, results
named ``..._autograd``).

Shapes: ``issue`` (hidden 2048, 16 heads, 64 experts top-8 of hidden 512, sequence 4096, 4
logical layers, 8 micro-batches: 32,768 tokens per step), ``large`` (hidden 4096, 32 heads, 64
experts top-8 of hidden 1024, sequence 8192, 4 layers, 8 micro-batches), ``tiny`` (a CPU check).
Writes ``mfu_<shape>_<device>[_autograd].{json,md}`` into ``--out``; ``--quick`` takes fewer
steps.
"""

from __future__ import annotations

import argparse
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
from common import recorded_command, sync, synthetic_batches
from trace_summary import kernel_breakdown, summarize_trace

CUDA = torch.cuda.is_available()

PATTERNS = {"star_e": "[*E]", "ge": "[GE]", "me": "[ME]", "plus_e": "[+E]"}
IMPLS = ("fast", "fast-graphs", "reference", "te", "gpt-te", "gpt-local")
GPT_PATTERNS = ("star_e", "plus_e")  # GPTModel has no GatedDeltaNet or Mamba layers

SHAPES = {
    "issue": dict(layers=4, hidden=2048, heads=16, experts=64, topk=8, expert_hidden=512,
                  seq=4096, mbs=1, microbatches=8, vocab=32768, gdn_heads=16, gdn_head_dim=128,
                  mamba_state=128, mamba_head_dim=64, mamba_groups=8, q_lora_rank=None,
                  kv_lora_rank=512, qk_head_dim=128, qk_rope_dim=64, v_head_dim=128),
    "large": dict(layers=4, hidden=4096, heads=32, experts=64, topk=8, expert_hidden=1024,
                  seq=8192, mbs=1, microbatches=8, vocab=32768, gdn_heads=32, gdn_head_dim=128,
                  mamba_state=128, mamba_head_dim=64, mamba_groups=8, q_lora_rank=1536,
                  kv_lora_rank=512, qk_head_dim=128, qk_rope_dim=64, v_head_dim=128),
    "tiny": dict(layers=2, hidden=64, heads=4, experts=8, topk=2, expert_hidden=32, seq=64,
                 mbs=1, microbatches=2, vocab=256, gdn_heads=2, gdn_head_dim=16,
                 mamba_state=16, mamba_head_dim=16, mamba_groups=2, q_lora_rank=None,
                 kv_lora_rank=32, qk_head_dim=16, qk_rope_dim=8, v_head_dim=16),
}  # fmt: skip

#: Dense bf16 peak FLOP/s by a device-name fragment (NVIDIA's data sheets, SXM parts).
PEAKS = (("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12),
         ("B200", 2250e12), ("L40S", 362e12))  # fmt: skip

TARGETS = (
    ("star_e fast MFU >= 0.30", lambda r: _get(r, "star_e/fast", "mfu"), 0.30, ">="),
    ("star_e fast GPU busy >= 0.80", lambda r: _get(r, "star_e/fast", "gpu_busy"), 0.80, ">="),
    ("ge / star_e fast step time <= 1.15",
     lambda r: _ratio(r, "ge/fast", "star_e/fast"), 1.15, "<="),
    ("star_e te / gpt-te step time <= 1.00",
     lambda r: _ratio(r, "star_e/te", "star_e/gpt-te"), 1.00, "<="),
)  # fmt: skip


def _get(results, run, key):
    return results.get(run, {}).get(key)


def _ratio(results, a, b):
    x, y = _get(results, a, "median_s"), _get(results, b, "median_s")
    return x / y if x and y else None


def peak_flops(args) -> tuple[float, str]:
    """The peak to divide by, and where it came from."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if not CUDA:
        return 1e12, "CPU placeholder (MFU meaningless on a CPU)"
    name = torch.cuda.get_device_name()
    for fragment, value in PEAKS:
        if fragment in name:
            return value, f"{fragment} dense bf16 data-sheet peak"
    raise SystemExit(f"mfu.py: no peak known for {name!r}; pass --peak-tflops")


def te_available() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def gdn_deterministic(args) -> bool:
    """Whether GatedDeltaNet runs the torch path (``deterministic_mode``) rather than fla."""
    if args.gdn_kernel != "auto":
        return args.gdn_kernel == "torch"
    if not CUDA:
        return True
    import importlib.util

    from megatron_hybrid.training.capabilities import fla_gated_backward_refused

    return importlib.util.find_spec("fla") is None or fla_gated_backward_refused() is not None


def build_config(shape: SimpleNamespace, pattern: str, impl: str, deterministic: bool):
    """The ``TransformerConfig`` of one run (``MLATransformerConfig`` for ``+``)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from megatron_hybrid.pattern import parse_pattern

    parsed = parse_pattern(pattern)
    fields = dict(
        num_layers=parsed.physical_layer_count,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        ffn_hidden_size=4 * shape.hidden,
        num_moe_experts=shape.experts,
        moe_router_topk=shape.topk,
        moe_ffn_hidden_size=shape.expert_hidden,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=impl in ("te", "gpt-te"),
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        bias_activation_fusion=True,
        cross_entropy_loss_fusion=True,
        cross_entropy_fusion_impl="native",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        deterministic_mode=deterministic,
        linear_num_key_heads=shape.gdn_heads,
        linear_num_value_heads=shape.gdn_heads,
        linear_key_head_dim=shape.gdn_head_dim,
        linear_value_head_dim=shape.gdn_head_dim,
        mamba_state_dim=shape.mamba_state,
        mamba_head_dim=shape.mamba_head_dim,
        mamba_num_groups=shape.mamba_groups,
    )
    if not CUDA:
        from megatron_hybrid.runtime.cpu import cpu_config_overrides

        fields.update(cpu_config_overrides(), deterministic_mode=deterministic)
    if "+" not in pattern:
        return TransformerConfig(**fields)
    return MLATransformerConfig(
        **fields, multi_latent_attention=True, q_lora_rank=shape.q_lora_rank,
        kv_lora_rank=shape.kv_lora_rank, qk_head_dim=shape.qk_head_dim,
        qk_pos_emb_head_dim=shape.qk_rope_dim, v_head_dim=shape.v_head_dim, rope_type="rope",
    )  # fmt: skip


def build_model(shape, pattern: str, impl: str, config, pg):
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.testing.models import build_gpt_twin, build_hybrid

    kwargs = dict(vocab_size=shape.vocab, max_sequence_length=shape.seq)
    torch.manual_seed(1234)
    if impl.startswith("gpt-"):
        model = build_gpt_twin(config, pattern, pg, backend=impl[4:], **kwargs)
    elif impl == "te":
        model = build_hybrid(config, pattern, pg, backend="te", **kwargs)
    elif impl == "fast-graphs":
        model = build_hybrid(config, pattern, pg, backend="local", local_impl="fast",
                             hybrid_cuda_graphs=True, **kwargs)  # fmt: skip
    else:
        model = build_hybrid(config, pattern, pg, backend="local", local_impl=impl, **kwargs)
    device = "cuda" if CUDA else "cpu"
    return Float16Module(config, model.to(device)), model


def wrap_ddp(model, config, pg):
    """``model`` in megatron's ``DistributedDataParallel`` as ``train`` wraps it: float32 gradient
    buffers (each parameter's ``main_grad``), the distributed optimizer's layout on a GPU."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=CUDA
    )
    return DistributedDataParallel(config, ddp_config, model, pg_collection=pg)


def profile(step) -> tuple[dict, dict]:
    """One step under torch.profiler: its summary and kernel breakdown."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("mh_step"):
            step()
            sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return summarize_trace(events), kernel_breakdown(events, top=15)


def measure(args, shape, name: str, impl: str, peak: float) -> dict:
    """One run: build, warm up, time, profile; the model is freed afterwards."""
    from megatron_hybrid.modules.fast import fast_path_report
    from megatron_hybrid.modules.fast.compiled import COMPILE_SECONDS
    from megatron_hybrid.modules.flops import SequenceBatch, model_flops
    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.overlap import run_schedule

    pattern = f"{PATTERNS[name]}{{{shape.layers}}}"
    # deterministic_mode selects megatron's torch GatedDeltaNet; other patterns run without it.
    deterministic = "G" in PATTERNS[name] and gdn_deterministic(args)
    if deterministic and impl in ("te", "gpt-te"):
        # megatron's TE attention refuses deterministic_mode unless TE's attention is told to
        # pick deterministic algorithms too (megatron.core.extensions.transformer_engine).
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    config = build_config(shape, pattern, impl, deterministic)
    pg = initialize_model_parallel(seed=1234)
    compiled_before = dict(COMPILE_SECONDS)
    model, inner = build_model(shape, pattern, impl, config, pg)
    if args.ddp:
        model = wrap_ddp(model, config, pg)
    batches = synthetic_batches(shape, shape.microbatches)

    def zero_grads():
        if args.ddp:
            model.zero_grad_buffer()
        model.zero_grad(set_to_none=True)

    def step():
        run_schedule([model], batches, config, seq_length=shape.seq, micro_batch_size=shape.mbs)

    warmup, steps = args.warmup, args.steps
    if args.quick and impl == "reference":  # seconds per step at the shape
        warmup, steps = 1, 2
    times, first = [], None
    for index in range(warmup + steps):
        if index == warmup and CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        zero_grads()
        sync()
        began = time.perf_counter()
        step()
        sync()
        elapsed = time.perf_counter() - began
        if index == 0:
            first = elapsed
        if index >= warmup:
            times.append(elapsed)
    median = statistics.median(times)
    tokens = shape.mbs * shape.seq * shape.microbatches
    flops = model_flops(config, pattern, SequenceBatch.uniform(shape.mbs * shape.microbatches,
                                                               shape.seq), shape.vocab)  # fmt: skip
    result = {
        "pattern": pattern,
        "impl": impl,
        "grads": "megatron DDP" if args.ddp else "autograd",
        "median_s": median,
        "steps_s": times,
        "first_step_s": first,
        "tokens_per_s": tokens / median,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0,
        "step_tflop": flops.step / 1e12,
        "tflop_by_part": {k: 3 * v / 1e12 for k, v in flops.by_symbol().items()},
        "mfu": flops.mfu(median, peak),
        "gdn_kernel": _gdn_label(impl, deterministic) if "G" in pattern else None,
        "compile_s": {k: v - compiled_before.get(k, 0.0) for k, v in COMPILE_SECONDS.items()
                      if v != compiled_before.get(k, 0.0)},  # fmt: skip
    }
    report = fast_path_report(inner)
    if report:
        result["fast_path"] = sorted({f"{k.split('.')[-1]}: {v}" for k, v in report.items()})
    graphs = getattr(inner, "hybrid_cuda_graphs", None)
    if graphs is not None:
        result["cuda_graphs"] = graphs.summary().splitlines()
    if CUDA and not args.no_profile:
        zero_grads()
        summary, breakdown = profile(step)
        window = summary["window_ms"]
        matmul_ms = sum(breakdown["categories"].get(c, {}).get("ms", 0.0)
                        for c in ("gemm", "attention"))  # fmt: skip
        result.update(
            profile=summary,
            kernels=breakdown,
            gpu_busy=summary["gpu_busy_ms"] / window,
            kernels_per_step=summary["compute_kernels"] + summary["nccl_kernels"],
            distance={
                "ideal_ms": flops.step / peak * 1e3,
                "profiled_step_ms": window,
                "gpu_idle_ms": summary["gpu_idle_ms"],
                "matmul_kernels_ms": matmul_ms,
                "other_kernels_ms": summary["compute_kernel_sum_ms"] - matmul_ms,
                "matmul_efficiency": flops.step / peak * 1e3 / matmul_ms if matmul_ms else None,
            },
        )
    return result  # the model goes with this frame; the caller collects it


def _gdn_label(impl: str, deterministic: bool) -> str:
    """What GatedDeltaNet ran: fla's kernels, the fast path's scan or megatron's torch loop."""
    if not deterministic:
        return "fla"
    return "torch scan" if impl.startswith("fast") else "torch loop"


def _fmt(value, spec=".3f") -> str:
    return "—" if value is None else format(value, spec)


def write(args, shape_name: str, meta: dict, results: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = meta["device"].replace(" ", "-")
    stem = (f"mfu_{shape_name}_{device}" + ("" if args.ddp else "_autograd")
            + ("_tf32" if args.tf32 else ""))  # fmt: skip
    targets = [(label, fn(results), bound, op) for label, fn, bound, op in TARGETS]
    checked = [dict(target=t, value=v, bound=b, met=_met(v, b, o)) for t, v, b, o in targets]
    (out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "results": results, "targets": checked}, indent=1)
    )
    lines = [
        f"# MFU, shape `{shape_name}`, {meta['device']}", "",
        f"{meta['date']}; torch {meta['torch']}; peak {meta['peak_tflops']:.0f} TFLOP/s "
        f"({meta['peak_source']}); {meta['setup']}.", "", f"`{meta['command']}`", "",
        "| run | step s | first step s | tokens/s | peak GiB | step TFLOP | MFU | GPU busy "
        "| kernels / step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for run, r in results.items():
        label = run if not r.get("gdn_kernel") else f"{run} ({r['gdn_kernel']})"
        lines.append(
            f"| {label} | {r['median_s']:.4f} | {r['first_step_s']:.2f} | {r['tokens_per_s']:,.0f} "
            f"| {r['peak_gib']:.2f} | {r['step_tflop']:.2f} | {r['mfu']:.4f} "
            f"| {_fmt(r.get('gpu_busy'))} | {r.get('kernels_per_step', '—')} |"
        )
    lines += ["", "| target | value | met |", "| --- | ---: | --- |"]
    for label, value, bound, op in targets:
        lines.append(f"| {label} | {_fmt(value)} | {_met(value, bound, op)} |")
    for run, r in results.items():
        if not ({"distance", "fast_path", "cuda_graphs"} & set(r) or r.get("compile_s")):
            continue
        lines += ["", f"## {run}", ""]
        if "distance" in r:
            d = r["distance"]
            lines.append(
                f"Profiled step {d['profiled_step_ms']:.1f} ms against {d['ideal_ms']:.1f} ms at "
                f"peak: GPU idle {d['gpu_idle_ms']:.1f} ms, non-matmul kernels "
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
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: 8 + len(results) + 3 + len(targets)]), flush=True)


def _met(value, bound, op) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= bound if op == ">=" else value <= bound) else "**not met**"


def default_runs(te: bool) -> list[tuple[str, str]]:
    runs = [(name, "fast") for name in PATTERNS] + [("star_e", "reference")]
    if te:
        runs += [(name, "te") for name in PATTERNS] + [("star_e", "gpt-te")]
    # Last: a capture that fails can leave the CUDA generator registered with the failed graph.
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
        if impl.startswith("gpt-") and name not in GPT_PATTERNS:
            parser.error(f"--runs {value!r}: GPTModel has no {PATTERNS[name]} layers; "
                         f"use {' or '.join(GPT_PATTERNS)}")  # fmt: skip
        runs.append((name, impl))
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="issue" if CUDA else "tiny")
    parser.add_argument("--runs", nargs="+", metavar="PATTERN/IMPL",
                        help="runs to measure, e.g. star_e/fast ge/te (default: every pattern "
                        "fast, star_e reference, where TE is importable every pattern te and "
                        "star_e gpt-te, then star_e fast-graphs)")  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true", help="2 warm-up and 4 timed steps (reference runs: 1 and 2)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step")
    parser.add_argument("--tf32", action="store_true",
                        help="let float32 matmuls use TF32 tensor cores (torch.backends.cuda."
                        "matmul.allow_tf32): the GatedDeltaNet scan's and the torch Mamba path's "
                        "float32 products; recorded in the results")  # fmt: skip
    parser.add_argument("--ddp", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap each model in megatron's DistributedDataParallel as train "
                        "does (float32 main_grad buffers; the distributed optimizer's layout on "
                        "a GPU); --no-ddp: plain autograd .grad (results get an _autograd "
                        "suffix)")  # fmt: skip
    parser.add_argument("--gdn-kernel", choices=("auto", "fla", "torch"), default="auto",
                        help="GatedDeltaNet: fla's Triton kernels, the torch path "
                        "(deterministic_mode; the fast path runs it as a parallel scan), or "
                        "fla where it can run its backward here (default)")  # fmt: skip
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's peak to divide by (default: from its name)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.steps = 2, 4
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    te = te_available()
    runs = parse_runs(parser, args.runs, te)
    skipped = [f"{n}/{i}" for n, i in runs if i in ("te", "gpt-te") and not te]
    runs = [(n, i) for n, i in runs if f"{n}/{i}" not in skipped]
    if skipped:
        print(f"skipped (TransformerEngine not importable): {', '.join(skipped)}")

    from megatron_hybrid.process_groups import init_single_process_world

    if CUDA:
        torch.cuda.set_device(0)
        init_single_process_world("nccl")
    else:  # a CPU check of the script (numbers meaningless): megatron-core's CUDA calls emulated
        from megatron_hybrid.runtime import select_backend

        select_backend("cpu").activate()
        init_single_process_world("gloo")
    peak, peak_source = peak_flops(args)
    shape = SimpleNamespace(**SHAPES[args.shape])
    meta = dict(
        device=torch.cuda.get_device_name() if CUDA else "CPU",
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        command=recorded_command("mfu.py", sys.argv[1:] if argv is None else argv),
        peak_tflops=peak / 1e12,
        peak_source=peak_source,
        shape={"name": args.shape, **SHAPES[args.shape]},
        setup=(f"hidden {shape.hidden}, {shape.heads} heads, {shape.experts} experts top-"
               f"{shape.topk} (hidden {shape.expert_hidden}), seq {shape.seq}, "
               f"{shape.layers} logical layers, {shape.microbatches} micro-batches of "
               f"{shape.mbs}, vocab {shape.vocab}, bf16, SwiGLU, "
               + ("megatron DDP (float32 main_grad)" if args.ddp else "plain autograd (.grad)")
               + (", TF32 float32 matmuls" if args.tf32 else "")),
        grads="megatron DDP" if args.ddp else "autograd",
        skipped=skipped,
    )  # fmt: skip
    results: dict = {}
    for name, impl in runs:
        run = f"{name}/{impl}"
        print(f"== {run}", flush=True)
        results[run] = measure(args, shape, name, impl, peak)
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        r = results[run]
        print(f"   {r['median_s']:.4f} s/step, first {r['first_step_s']:.2f} s, "
              f"{r['tokens_per_s']:,.0f} tokens/s, {r['peak_gib']:.2f} GiB, MFU {r['mfu']:.4f}, "
              f"GPU busy {_fmt(r.get('gpu_busy'))}", flush=True)  # fmt: skip
        write(args, args.shape, meta, results)  # after every run: a cut-off job keeps its figures
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

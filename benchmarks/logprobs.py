"""Tokens/s of ``forward_logprobs``: packed (THD) vs padded (BSHD rows), one GPU.

    python benchmarks/logprobs.py --out benchmarks/results
    python benchmarks/logprobs.py --tiny                       # a CPU smoke run of the script

The model is shaped like Qwen3.5-35B-A3B (Qwen3.5-MoE: hidden 2048, ``([GE]{3}[*E])`` periods,
GatedDeltaNet with 16 key / 32 value heads of 128, attention with 16 query / 2 KV heads of 256,
256 experts of 512 with top 8 and a shared expert of 512, vocabulary 248,320), built from that
Hugging Face config through ``megatron_hybrid.hf`` with random weights, ``--layers`` deep, bf16.
Sequence lengths are drawn uniformly between ``--min-len`` and ``--max-len`` (each set varies by
``max/min`` >= 2x) until ``--tokens`` real tokens; both layouts score the same sequences with
``--max-tokens`` tokens per micro-batch: packed = THD micro-batches, padded = the same sequences
in ``[B, S]`` rows (longest first, ``B x S <= max-tokens``). The figure is real tokens per second
of the whole call (median of ``--repeats`` after one warm-up call, which also compiles fla's
kernels); the log-probs of the two layouts are compared as a check. With ``--profile``, after the
routing flips below, one more call per layout runs under torch.profiler and the report says where
it goes: GPU busy and idle, the kernels by category and the costliest ones, the host's operators
by their own time; two more calls under hooks on every module (``benchmarks/host_breakdown.py``)
give the host's time and torch operators per module class and the Python sites of
``repeat_interleave``.

An untimed pass of each layout records every router's chosen experts
(``benchmarks/routing_flips.py``): the report counts the tokens whose top-k expert set differs
between packed and padded (per MoE layer), and how much of the log-prob difference falls on
tokens at or after a sequence's first flip, against the largest difference elsewhere.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import host_cpu, recorded_command, sync
from host_breakdown import module_host_times, module_operators
from routing_flips import RoutingRecorder, flip_report
from trace_summary import profile_call, sync_sites

#: Qwen3.5-35B-A3B's text config (Qwen3.5-MoE), the shape the benchmark model takes.
QWEN35_MOE = {
    "model_type": "qwen3_5_moe_text",
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "vocab_size": 248320,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}

#: A CPU-sized variant for ``--tiny`` (the script's logic, not a speed figure).
TINY = dict(hidden_size=64, num_attention_heads=4, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, vocab_size=256)  # fmt: skip


def _setup():
    from megatron_hybrid.process_groups import init_single_process_world, initialize_model_parallel

    if torch.cuda.is_available():
        init_single_process_world("nccl")
    else:
        from megatron_hybrid.runtime.cpu import enable_cpu_emulation

        enable_cpu_emulation()
        init_single_process_world("gloo")
    return initialize_model_parallel(tp=1, seed=1234)


def build(args, pg):
    """The Qwen3.5-MoE-shaped HybridModel (random weights) and its vocabulary size."""
    from megatron_hybrid.hf.api import build_model
    from megatron_hybrid.hf.config import hf_config_to_megatron

    config = dict(QWEN35_MOE, **(TINY if args.tiny else {}))
    if args.experts:
        config["num_experts"] = args.experts
    config["num_hidden_layers"] = args.layers
    config["layer_types"] = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)
    ]
    conversion = hf_config_to_megatron(config, mtp=False)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    torch.manual_seed(0)
    return build_model(conversion, pg, params_dtype=dtype).eval(), config["vocab_size"]


def lengths(args) -> list[int]:
    gen = torch.Generator().manual_seed(args.seed)
    out = []
    while sum(out) < args.tokens:
        out.append(int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=gen)))
    return out


def scorer(model, sequences, packed: bool, args):
    """The benchmark's ``forward_logprobs`` call of one layout, as a function of no arguments."""
    from megatron_hybrid.logprobs import forward_logprobs

    return functools.partial(
        forward_logprobs, model, sequences, max_tokens_per_micro_batch=args.max_tokens,
        packed=packed,
    )  # fmt: skip


def measure(model, sequences, packed: bool, args) -> tuple[dict, list]:
    call = scorer(model, sequences, packed, args)
    result = call()  # warm-up (fla compiles and autotunes its kernels here)
    times = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    real = sum(len(s) for s in sequences)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    row = dict(
        layout="packed" if packed else "padded",
        seconds=seconds,
        tokens_per_s=real / seconds,
        micro_batches=_micro_batches(sequences, packed, args),
        peak_gib=peak,
    )
    return row, result


def profile(model, sequences, packed: bool, args) -> dict:
    """One profiled call of a layout, one under sync debug mode and two under module hooks.

    Run after the routing flips are recorded (:func:`routing_flips`), so the flips and the
    log-probs they explain come from the same, unprofiled state of the process (a profiled run
    of 2026-11-28 that recorded them after these calls reported up to 0.642 of difference
    before any flip; the same code unprofiled, 0.0195)."""
    call = scorer(model, sequences, packed, args)
    summary, breakdown, host = profile_call(call, sync, top=12)
    found = dict(summary=summary, kernels=breakdown, host=host, syncs=sync_sites(call))
    call_ms, times = module_host_times([model], call)
    operators, sites = module_operators([model], call)
    found.update(hooked_ms=call_ms, modules=times[:12], operators=operators[:12],
                 op_sites=sites[:12])  # fmt: skip
    return found


def _profile_lines(row: dict) -> list[str]:
    """The profiled call of one layout, as lines of the report."""
    s, kernels = row["profile"]["summary"], row["profile"]["kernels"]
    lines = [
        f"### profiled {row['layout']} call: {s['window_ms']:.0f} ms, GPU busy "
        f"{s['gpu_busy_ms']:.0f} ms, idle {s['gpu_idle_ms']:.0f} ms; host in operators "
        f"{s['cpu_op_busy_ms']:.0f} ms ({s['cpu_ops']} ops), waiting on syncs "
        f"{s['cpu_sync_wait_ms']:.0f} ms; {s['compute_kernels']} kernels",
        "",
        "| kernel category | ms | count |",
        "| --- | ---: | ---: |",
        *(f"| {c} | {v['ms']:.1f} | {v['count']} |" for c, v in kernels["categories"].items()),
        "",
        "| kernel | category | ms | count | mean us |",
        "| --- | --- | ---: | ---: | ---: |",
        *(
            f"| `{k['name'][:80]}` | {k['category']} | {k['ms']:.1f} | {k['count']} | "
            f"{k['mean_us']:.0f} |"
            for k in kernels["kernels"]
        ),
        "",
        "| host operator | self ms | count |",
        "| --- | ---: | ---: |",
        *(f"| `{h['name'][:80]}` | {h['self_cpu_ms']:.1f} | {h['count']} |"
          for h in row["profile"]["host"]),  # fmt: skip
        "",
        "| host-GPU synchronisation site (one more call, sync debug mode) | count |",
        "| --- | ---: |",
        *(f"| `{x['site']}` | {x['count']} |" for x in row["profile"]["syncs"]),
        "",
        f"host time by module, exclusive (one more call under hooks, "
        f"{row['profile']['hooked_ms']:.0f} ms; benchmarks/host_breakdown.py):",
        "",
        "| module | self ms | calls |",
        "| --- | ---: | ---: |",
        *(f"| {m['module']} | {m['self_ms']:.1f} | {m['calls']} |"
          for m in row["profile"]["modules"]),  # fmt: skip
        "",
        "| module | torch operators (exclusive) |",
        "| --- | ---: |",
        *(f"| {m['module']} | {m['ops']} |" for m in row["profile"]["operators"]),
        "",
        "| operator | site | count |",
        "| --- | --- | ---: |",
        *(f"| `{x['op']}` | `{x['site']}` | {x['count']} |" for x in row["profile"]["op_sites"]),
        "",
    ]
    return lines


def _micro_batches(sequences, packed: bool, args) -> int:
    from megatron_hybrid.logprobs.batches import micro_batch_groups
    from megatron_hybrid.padding import PaddingConfig

    sizes = [len(s) for s in sequences if len(s) > 1]
    return len(micro_batch_groups(sizes, PaddingConfig(), args.max_tokens, packed, None))


def routing_flips(model, sequences, results, args) -> dict:
    """The routing flips between the packed and the padded run (untimed, hooks on)."""
    sets = {}
    for packed in (True, False):
        with RoutingRecorder(model, sequences) as recorder:
            scorer(model, sequences, packed, args)()
        sets[packed] = recorder.expert_sets()
    differences = [
        (a.float() - b.float()).abs().cpu()
        for a, b in zip(results[True], results[False], strict=True)
    ]
    return flip_report(sets[True], sets[False], differences)


def _flip_lines(flips: dict) -> list[str]:
    per_layer = ", ".join(str(n) for n in flips["flips_per_layer"])
    return [
        f"routing flips (top-k expert set differs, packed vs padded): {flips['tokens_with_flip']} "
        f"of {flips['tokens']} tokens in some MoE layer; per MoE layer: {per_layer}",
        f"{100 * flips['downstream_share']:.1f} % of the summed |log-prob difference| falls on the "
        f"{flips['downstream_tokens']} tokens at or after a sequence's first flip; largest "
        f"difference there {flips['max_downstream']:.3g}, elsewhere {flips['max_elsewhere']:.3g}",
    ]


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# forward_logprobs: packed vs padded ({meta['device']}; {meta['host']})",
        "",
        f"{meta['date']}; Qwen3.5-MoE-shaped, {meta['layers']} layers, {meta['experts']} experts, "
        f"{meta['dtype']}, {meta['max_tokens']} tokens per micro-batch; {meta['sequences']} "
        f"sequences of {meta['min_len']}-{meta['max_len']} tokens ({meta['tokens']} real); median "
        f"of {meta['repeats']} calls after a warm-up. Command: `{meta['command']}`.",
        "",
        "| layout | real tok/s | seconds | micro-batches | peak GiB | packed speed-up |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    padded = next((r for r in rows if r["layout"] == "padded"), None)
    for r in rows:
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        gain = (
            f"{r['tokens_per_s'] / padded['tokens_per_s']:.2f}x" if padded not in (r, None) else ""
        )
        lines.append(
            f"| {r['layout']} | {r['tokens_per_s']:,.0f} | {r['seconds']:.3f} | "
            f"{r['micro_batches']} | {peak} | {gain} |"
        )
    lines.append("")
    if meta["max_abs_diff"] is not None:
        lines.append(f"max |log-prob packed - padded| = {meta['max_abs_diff']:.3g}")
    if meta.get("routing_flips") is not None:
        lines += ["", *_flip_lines(meta["routing_flips"])]
    for r in rows:
        if "profile" in r:
            lines += ["", *_profile_lines(r)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="depth (multiple of 4 keeps periods)")
    parser.add_argument("--experts", type=int, default=None, help="experts (default: 256)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens per micro-batch")
    parser.add_argument("--tokens", type=int, default=65536, help="real tokens to score")
    parser.add_argument("--min-len", type=int, default=512, help="shortest sequence")
    parser.add_argument("--max-len", type=int, default=4096, help="longest sequence")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per layout")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and tokens")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized model (a smoke run)")
    parser.add_argument("--profile", action="store_true",
                        help="one more call per layout under torch.profiler (GPU)")  # fmt: skip
    parser.add_argument("--layouts", nargs="+", choices=("packed", "padded"),
                        default=["packed", "padded"], help="which layouts to score")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="folder for the results files")
    args = parser.parse_args(argv)
    if args.max_len < 2 * args.min_len:
        parser.error("--max-len must be at least 2 x --min-len (lengths varying 2x or more)")
    if args.max_len > args.max_tokens:
        parser.error("--max-len must fit in --max-tokens")

    pg = _setup()
    model, vocab = build(args, pg)
    gen = torch.Generator().manual_seed(args.seed + 1)
    sequences = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths(args)]
    rows, results = [], {}
    for layout in args.layouts:
        packed = layout == "packed"
        row, results[packed] = measure(model, sequences, packed, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    both = len(results) == 2
    diff = (
        max(
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(results[True], results[False], strict=True)
            if a.numel()
        )
        if both
        else None
    )
    flips = routing_flips(model, sequences, results, args) if both else None
    if args.profile and torch.cuda.is_available():
        for row in rows:
            row["profile"] = profile(model, sequences, row["layout"] == "packed", args)
            # Printed now, not only in the table: a later layout may not finish.
            print("\n".join(_profile_lines(row)), flush=True)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    meta = dict(
        device=name,
        host=host_cpu(),
        date=datetime.date.today().isoformat(),
        dtype="bf16" if torch.cuda.is_available() else "float32",
        layers=args.layers,
        experts=args.experts or (TINY if args.tiny else QWEN35_MOE)["num_experts"],
        max_tokens=args.max_tokens,
        sequences=len(sequences),
        min_len=args.min_len,
        max_len=args.max_len,
        tokens=sum(len(s) for s in sequences),
        repeats=args.repeats,
        max_abs_diff=diff,
        routing_flips=flips,
        command=recorded_command("logprobs.py", sys.argv[1:] if argv is None else list(argv)),
    )
    table = _markdown(rows, meta)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"logprobs_{name.replace(' ', '-')}"
        stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        stem.with_suffix(".md").write_text(table)
    if len(rows) < 2:
        return 0
    packed, padded = rows
    return 0 if packed["tokens_per_s"] > padded["tokens_per_s"] else 1


if __name__ == "__main__":
    sys.exit(main())

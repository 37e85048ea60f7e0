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

Writes ``ep_overlap_<label>_<N>gpu.{json,md,png}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


VARIANTS = (
    "gpt_plain", "gpt_overlap", "grouped_plain", "grouped_overlap", "ungrouped_plain",
    "ge_plain", "ge_overlap",
)  # fmt: skip


def _config(args, pattern: str, overlap: bool, ep: int):
    from megatron.core.transformer import TransformerConfig

    from megatron_hybrid.pattern import parse_pattern

    parsed = parse_pattern(pattern)
    gdn = parsed.layer_counts["G"] > 0
    extra = {}
    if gdn:
        # GatedDeltaNet takes the model's activation, which must be SiLU. deterministic_mode
        # selects megatron's torch GDN path; fla's kernels need Triton >= 3.7.1 on Hopper for
        # their gated backward (fla 0.6.0 refuses older Triton there: wrong results, fla #640).
        extra = dict(activation_func=torch.nn.functional.silu, gated_linear_unit=True,
                     linear_num_key_heads=16, linear_num_value_heads=16,
                     linear_key_head_dim=128, linear_value_head_dim=128,
                     deterministic_mode=args.gdn_kernel == "torch")  # fmt: skip
    if not torch.cuda.is_available():  # CPU smoke runs of this script
        from megatron_hybrid.testing.cpu import cpu_config_overrides

        extra.update(cpu_config_overrides())
    return TransformerConfig(
        num_layers=parsed.physical_layer_count,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.expert_hidden,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ep,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        overlap_moe_expert_parallel_comm=overlap,
        **extra,
    )


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
    config = _config(args, pattern, overlap, ep)
    builder = build_gpt_twin if variant.startswith("gpt") else build_hybrid
    torch.manual_seed(1234)
    model = builder(config, pattern, pg, vocab_size=args.vocab,
                    max_sequence_length=args.seq).to(DEVICE)  # fmt: skip
    return Float16Module(config, model), config


def _batches(args, count: int):
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), generator=generator)
        out.append(dict(
            input_ids=tokens[:, :-1].to(DEVICE), labels=tokens[:, 1:].to(DEVICE),
            position_ids=torch.arange(args.seq, device=DEVICE).expand(args.mbs, -1),
            loss_mask=torch.ones(args.mbs, args.seq, device=DEVICE), attention_mask=None,
        ))  # fmt: skip
    return out


def measure(variant: str, args, pg, ep: int) -> dict:
    """Median step time and peak memory of one variant."""
    from megatron_hybrid.testing.overlap import run_schedule

    model, config = _build(variant, args, pg, ep)
    batches = _batches(args, args.microbatches)
    # The torch GatedDeltaNet path is slow at this size: fewer steps keep the run short.
    slow = variant.startswith("ge") and args.gdn_kernel == "torch"
    warmup, steps = (1, max(2, args.steps // 2)) if slow else (args.warmup, args.steps)
    times = []
    for step in range(warmup + steps):
        if step == warmup and CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        _sync()
        began = time.perf_counter()
        run_schedule([model], batches, config, seq_length=args.seq, micro_batch_size=args.mbs)
        _sync()
        if step >= warmup:
            times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0
    # The slowest rank decides the step; take each step's max over ranks.
    t = torch.tensor(times, device=DEVICE)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    m = torch.tensor([peak], device=DEVICE)
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX)
    del model
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return {"median_s": statistics.median(t.tolist()), "steps_s": t.tolist(),
            "peak_gib": float(m.item())}  # fmt: skip


def summarize(results: dict) -> dict:
    """The ratios DESIGN.md section 7 sets targets for."""

    def ratio(a, b, key):
        if a not in results or b not in results or not results[b][key]:
            return None
        return results[a][key] / results[b][key]

    return {
        "grouped_vs_gpt_overlap_time": ratio("grouped_overlap", "gpt_overlap", "median_s"),
        "grouped_vs_gpt_overlap_memory": ratio("grouped_overlap", "gpt_overlap", "peak_gib"),
        "gpt_overlap_speedup": ratio("gpt_plain", "gpt_overlap", "median_s"),
        "grouped_overlap_speedup": ratio("grouped_plain", "grouped_overlap", "median_s"),
        "ge_overlap_speedup": ratio("ge_plain", "ge_overlap", "median_s"),
        "grouped_plain_vs_ungrouped_plain_time": ratio("grouped_plain", "ungrouped_plain",
                                                       "median_s"),
    }  # fmt: skip


def write_outputs(out: Path, name: str, meta: dict, results: dict, ratios: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(
        {"meta": meta, "results": results, "ratios": ratios}, indent=2))  # fmt: skip
    lines = [
        f"# EP overlap: {meta['label']}, {meta['gpus']} x {meta['gpu']}",
        "",
        f"Date {meta['date']}; command `{meta['command']}`; {meta['setup']}.",
        "",
        "| variant | median step (s) | peak memory (GiB) |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {v} | {r['median_s']:.4f} | {r['peak_gib']:.2f} |" for v, r in results.items()]
    lines += ["", "| ratio | value |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.3f} |" for k, v in ratios.items() if v is not None]
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


def _command(args, ep: int) -> str:
    extra = " --variants " + " ".join(args.variants) if args.variants != list(VARIANTS) else ""
    extra += f" --gdn-kernel {args.gdn_kernel}" if args.gdn_kernel != "torch" else ""
    extra += " --append" if args.append else ""
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
        args=vars(args),
    )
    write_outputs(Path(args.out), f"ep_overlap_{args.label}_{ep}gpu", meta, results, ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="network setting, e.g. nvlink, no-p2p")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
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
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
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
    args = parser.parse_args()

    if CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
    else:  # a CPU smoke run (numbers meaningless): megatron-core needs its CUDA calls emulated
        from megatron_hybrid.testing.cpu import enable_cpu_emulation

        enable_cpu_emulation()
        torch.distributed.init_process_group("gloo")
    from megatron_hybrid.testing.megatron_state import initialize_model_parallel

    ep = torch.distributed.get_world_size()
    results, commands = {}, [_command(args, ep)]
    previous = Path(args.out) / f"ep_overlap_{args.label}_{ep}gpu.json"
    if args.append and previous.exists():
        earlier = json.loads(previous.read_text())
        results = {k: v for k, v in earlier["results"].items() if k not in args.variants}
        commands = earlier["meta"].get("commands", [earlier["meta"]["command"]]) + commands
        for key, value in earlier["meta"]["args"].items():
            now = vars(args).get(key)
            if key not in ("variants", "append", "gdn_kernel", "out") and now != value:
                parser.error(f"--append: {key} was {value!r} in {previous}, now {now!r}")
    for variant in args.variants:
        if variant.startswith("ge"):
            try:
                import fla  # noqa: F401
            except ImportError:
                print(f"{variant}: skipped, fla-core is not installed")
                continue
        pg = initialize_model_parallel(ep=ep, seed=1234)
        results[variant] = measure(variant, args, pg, ep)
        if variant.startswith("ge"):
            results[variant]["gdn_kernel"] = args.gdn_kernel
        if torch.distributed.get_rank() == 0:
            r = results[variant]
            print(f"{variant:>16}: {r['median_s']:.4f} s  {r['peak_gib']:.2f} GiB", flush=True)
            _write(
                args, ep, results, commands
            )  # after every variant, so a cut-off run keeps its figures
    if torch.distributed.get_rank() == 0:
        for key, value in summarize(results).items():
            if value is not None:
                print(f"{key}: {value:.3f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

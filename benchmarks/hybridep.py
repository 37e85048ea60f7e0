"""HybridEP vs alltoall: step time, and padded vs real tokens, on variable-length batches.

    torchrun --nproc_per_node 4 benchmarks/hybridep.py --label nvlink --out benchmarks/results
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node 4 benchmarks/hybridep.py --label no-p2p ...

Model: the grouped ``[*E]{L}`` HybridModel (hidden 2048, 16 heads, 16 experts top-4 with expert
hidden 4096, ``local`` backend, bf16), EP = number of GPUs. Data: the ``train`` command's
synthetic sequences (log-normal lengths, median half of ``--seq``), different on every rank, as
``--mbs`` rows per micro-batch. Every variant gets the same weights and the same sequences:

* ``alltoall``: megatron-core's alltoall dispatcher on our padded rows (``padding_config_from``
  aligned, then made equal across the TP x EP group once per micro-batch, as ``train`` does);
* ``hybridep``: the flex dispatcher's hybridep backend on the same rows;
* ``hybridep_mcore_pad``: hybridep on rows padded only to each rank's longest row, with
  megatron-core's ``moe_hybridep_pad_uneven_dispatch_inputs`` (a MAX all-reduce and a pad in
  every MoE layer): what runs without our planners. Attention and the dense layers then see
  fewer tokens; HybridEP moves as many.

A step is the forward and backward pass of ``--microbatches`` micro-batches through
megatron-core's schedule (no optimizer). Reported per variant: median step time over the timed
steps (the slowest rank's), tokens per step summed over ranks (``real``; ``padded``, what the
dense layers compute; ``dispatched``, what HybridEP moves per MoE layer), real tokens per second
and peak memory. HybridEP's kernels are compiled during the warm-up steps (its buffer is sized
for ``--mbs x --seq`` tokens first, so no later step recompiles). With ``NCCL_P2P_DISABLE=1``
NCCL's traffic goes through host memory; HybridEP moves tokens over NVLink itself (CUDA IPC) and
uses NCCL only for its routing-map all-gather.

Writes ``hybridep_<label>_<N>gpu.{json,md}`` into ``--out``, with the GPU, date and command.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from common import moe_bench_config, recorded_command, sync

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
VARIANTS = ("alltoall", "hybridep", "hybridep_mcore_pad")


def bench_config(args, ep: int, variant: str):
    extra = {}
    if variant.startswith("hybridep"):
        extra = dict(
            moe_token_dispatcher_type="flex",
            moe_flex_dispatcher_backend="hybridep",
            moe_hybridep_pad_uneven_dispatch_inputs=variant == "hybridep_mcore_pad",
        )
    return moe_bench_config(
        args, num_layers=2 * args.layers, ep=ep, moe_router_dtype="fp32", **extra
    )


def token_counts(batches: list[dict], dispatched: list[int]) -> dict[str, int]:
    """Real, padded and dispatched tokens of one rank's micro-batches.

    >>> token_counts([{"num_tokens": 5, "input_ids": torch.zeros(2, 4)}], [8])
    {'real': 5, 'padded': 8, 'dispatched': 8}
    """
    return {
        "real": sum(b["num_tokens"] for b in batches),
        "padded": sum(b["input_ids"].numel() for b in batches),
        "dispatched": sum(dispatched),
    }


def make_batches(args, config, pg, rank: int, ours: bool) -> tuple[list[dict], list[int]]:
    """This rank's micro-batches: our padding (``ours``) or each rank's longest row only; and
    the tokens each dispatches (megatron's own pad rounds the group maximum up to 64)."""
    from megatron.core.transformer.moe.fused_a2a import HYBRIDEP_TOKEN_ALIGNMENT

    from megatron_hybrid.data.batches import build_micro_batch
    from megatron_hybrid.data.samples import TokenSample
    from megatron_hybrid.data.synthetic import SyntheticTokens
    from megatron_hybrid.padding import padding_config_from

    # Both dispatchers get the rows hybridep needs (alltoall's own config plans no HybridEP term).
    padding = dataclasses.replace(padding_config_from(config, pg), hybridep=ours)
    data = SyntheticTokens(vocab_size=args.vocab, max_length=args.seq, seed=args.seed)
    fixed = args.seq if padding.fixed_length_required else None  # as train's padded rows

    def build(indices):
        samples = [TokenSample(data.sequence(i)) for i in indices]
        return build_micro_batch(samples, padding, packed=False, fixed_length=fixed,
                                 equalize_group=pg.tp_ep if ours else None)  # fmt: skip

    world = torch.distributed.get_world_size()
    batches = [
        build([(m * world + rank) * args.mbs + i for i in range(args.mbs)]).to(DEVICE).step_inputs()
        for m in range(args.microbatches)
    ]
    counts = torch.tensor([b["input_ids"].numel() for b in batches], device=DEVICE)
    if not ours:  # megatron-core pads every MoE layer's input to the group maximum
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=pg.tp_ep)
        counts += -counts % HYBRIDEP_TOKEN_ALIGNMENT
    return batches, counts.tolist()


@functools.cache
def _cached_kernel_buffers() -> None:
    """Every HybridEP buffer this process makes reloads the kernels it compiled before."""
    from megatron.core.transformer.moe import fused_a2a

    fused_a2a.HybridEPBuffer = functools.partial(fused_a2a.HybridEPBuffer, load_cached_kernels=True)


def measure(variant: str, args, ep: int, rank: int) -> dict:
    """Step times, token counts and peak memory of one variant."""
    from megatron.core.transformer.module import Float16Module

    from megatron_hybrid.process_groups import initialize_model_parallel
    from megatron_hybrid.testing.models import build_hybrid
    from megatron_hybrid.testing.overlap import run_schedule

    pg = initialize_model_parallel(ep=ep, etp=1, seed=1234)
    config = bench_config(args, ep, variant)
    pattern = f"[*E]{{{args.layers}}}"
    torch.manual_seed(1234)
    model = build_hybrid(config, pattern, pg, vocab_size=args.vocab,
                         max_sequence_length=args.seq).to(DEVICE)  # fmt: skip
    model = Float16Module(config, model)
    batches, dispatched = make_batches(args, config, pg, rank, ours=variant != "hybridep_mcore_pad")
    if variant.startswith("hybridep"):
        from megatron.core.transformer.moe import fused_a2a

        _cached_kernel_buffers()
        fused_a2a.reset_hybrid_ep_buffer()
        fused_a2a.init_hybrid_ep_buffer(
            pg.tp_ep, args.hidden, args.mbs * args.seq, args.experts // ep,
            num_sms_preprocessing_api=config.moe_hybridep_num_sms_preprocessing,
        )  # fmt: skip
    times = []
    for index in range(args.warmup + args.steps):
        if index == args.warmup and CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        sync()
        began = time.perf_counter()
        run_schedule([model], batches, config, seq_length=args.seq, micro_batch_size=args.mbs)
        sync()
        if index >= args.warmup:
            times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0
    stats = torch.tensor(times + [peak], device=DEVICE)
    torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX)
    tokens = torch.tensor(list(token_counts(batches, dispatched).values()), device=DEVICE)
    torch.distributed.all_reduce(tokens)
    del model, batches
    if variant.startswith("hybridep"):
        fused_a2a.reset_hybrid_ep_buffer()
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    steps = stats[:-1].tolist()
    real, padded, moved = tokens.tolist()
    return {
        "median_s": statistics.median(steps), "steps_s": steps, "peak_gib": stats[-1].item(),
        "real_tokens": real, "padded_tokens": padded, "dispatched_tokens": moved,
        "pad_overhead": padded / real - 1, "real_tokens_per_s": real / statistics.median(steps),
    }  # fmt: skip


def write_outputs(out: Path, name: str, meta: dict, results: dict) -> None:
    """``<name>.json`` and a Markdown table ``<name>.md``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = [
        f"# HybridEP vs alltoall: {meta['label']}, {meta['gpus']} x {meta['gpu']}",
        "",
        f"Date {meta['date']}; command `{meta['command']}`; {meta['setup']}.",
        "",
        "| variant | median step (s) | real tokens/step | padded (dense layers) | pad overhead "
        "| dispatched per MoE layer | real tokens/s | peak memory (GiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v, r in results.items():
        lines.append(
            f"| {v} | {r['median_s']:.4f} | {r['real_tokens']} | {r['padded_tokens']} | "
            f"{100 * r['pad_overhead']:.1f}% | {r['dispatched_tokens']} | "
            f"{r['real_tokens_per_s']:,.0f} | {r['peak_gib']:.2f} |"
        )
    base = results.get("alltoall")
    if base:
        lines += ["", "Step time relative to alltoall: " + ", ".join(
            f"{v} {r['median_s'] / base['median_s']:.3f}" for v, r in results.items())]  # fmt: skip
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="network setting, e.g. nvlink, no-p2p")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--layers", type=int, default=4, help="[*E] groups")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--expert-hidden", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=4096, help="longest sequence")
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seed", type=int, default=1234, help="data seed")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    ep = int(os.environ.get("WORLD_SIZE", "1"))
    if args.experts % ep:
        parser.error(f"--experts {args.experts} must be divisible by the {ep} GPUs (EP = GPUs)")
    variants = list(args.variants)
    if CUDA:
        from megatron_hybrid.training.capabilities import flex_backend_unavailable

        problem = flex_backend_unavailable("hybridep")
    else:
        problem = "needs CUDA GPUs"
    if problem and any(v.startswith("hybridep") for v in variants):
        print(f"hybridep variants skipped: HybridEP {problem}")
        variants = [v for v in variants if not v.startswith("hybridep")]
    if CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
    else:  # a CPU smoke run (numbers meaningless): megatron-core needs its CUDA calls emulated
        from megatron_hybrid.runtime.cpu import enable_cpu_emulation

        enable_cpu_emulation()
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    p2p = os.environ.get("NCCL_P2P_DISABLE") == "1"
    launcher = f"{'NCCL_P2P_DISABLE=1 ' if p2p else ''}torchrun --nproc_per_node {ep}"
    meta = dict(
        label=args.label, gpus=ep, gpu=torch.cuda.get_device_name() if CUDA else "CPU",
        date=datetime.date.today().isoformat(),
        command=recorded_command("hybridep.py", argv, launcher=launcher),
        setup=(f"[*E]{{{args.layers}}}, hidden {args.hidden}, {args.experts} experts top-"
               f"{args.topk} (expert hidden {args.expert_hidden}), sequences up to {args.seq} "
               f"tokens, mbs {args.mbs}, {args.microbatches} micro-batches, bf16, local backend, "
               f"EP={ep}, NCCL_P2P_DISABLE={int(p2p)}"),
        args={k: v for k, v in vars(args).items() if k != "out"},
    )  # fmt: skip
    results = {}
    name = f"hybridep_{args.label}_{ep}gpu"
    for variant in variants:
        results[variant] = r = measure(variant, args, ep, rank)
        if rank == 0:
            print(
                f"{variant:>20}: {r['median_s']:.4f} s, {r['real_tokens']} real / "
                f"{r['padded_tokens']} padded tokens, {r['peak_gib']:.2f} GiB",
                flush=True,
            )
            write_outputs(Path(args.out), name, meta, results)  # a cut-off run keeps its figures
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""CPU step time of ``train`` on Mamba patterns (the torch Mamba2 path), beside attention alone.

    python benchmarks/mamba_cpu_train.py --out benchmarks/results
    python benchmarks/mamba_cpu_train.py --patterns '(M-M*-){2}' --seq-length 512 --threads 2

Runs ``python -m megatron_hybrid train``'s own ``run_training`` in a fresh process per pattern
(megatron-core keeps process-global state) with its defaults (hidden 64, micro-batch 4,
synthetic data) and times every ``train_step`` call: forward, backward and optimizer step of
one global batch. Reports the median step time after ``--warmup`` steps and the loss of the
first and last step. The default comparison, ``(*-*-){2}``, has the same layer count with
attention in place of Mamba. Adds ``mamba_cpu_train.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from common import cpu_name


def _worker(rank: int, world_size: int, argv: list[str], threads: int) -> dict:
    """``run_training`` with every ``train_step`` call timed (runs in a spawned process)."""
    import time

    import torch

    torch.set_num_threads(threads)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training import loop
    from megatron_hybrid.training.run import run_training
    from megatron_hybrid.training.train_settings import settings_from_args

    seconds: list[float] = []
    step = loop.train_step

    def timed_step(*args, **kwargs):
        began = time.perf_counter()
        result = step(*args, **kwargs)
        seconds.append(time.perf_counter() - began)
        return result

    loop.train_step = timed_step  # run_training imports it from the module when it starts
    summary = run_training(
        settings_from_args(build_parser(load_commands()).parse_args(["train", *argv]))
    )
    return dict(seconds=seconds, losses=summary.losses)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--patterns", nargs="+", default=["(M-M*-){2}", "(*-*-){2}"], help="patterns to time"
    )
    parser.add_argument("--seq-length", type=int, default=256, help="train --seq-length")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="train --micro-batch-size")
    parser.add_argument("--steps", type=int, default=12, help="train --train-iters")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=None, help="folder for the results files")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")

    from megatron_hybrid.testing.spawn import run_distributed

    rows = []
    for pattern in args.patterns:
        argv = [
            "--hybrid-layer-pattern", pattern, "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--train-iters", str(args.steps),
        ]  # fmt: skip
        (result,) = run_distributed(_worker, 1, argv, args.threads, timeout=1800)
        timed = result["seconds"][args.warmup :]
        rows.append(
            dict(
                pattern=pattern,
                median_step_s=statistics.median(timed),
                min_step_s=min(timed),
                max_step_s=max(timed),
                first_loss=result["losses"][0],
                last_loss=result["losses"][-1],
            )
        )
        print(json.dumps(rows[-1]), flush=True)

    meta = dict(
        cpu=cpu_name(),
        date=datetime.date.today().isoformat(),
        threads=args.threads,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        steps=args.steps,
        warmup=args.warmup,
    )
    lines = [
        f"# `train` step time on CPU ({meta['cpu']}, {args.threads} threads)",
        "",
        f"{meta['date']}; train defaults (hidden 64, float32), sequence {args.seq_length}, "
        f"micro-batch {args.micro_batch_size}; median over steps {args.warmup + 1}-{args.steps}.",
        "",
        "| pattern | median step s | min | max | loss first -> last |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| `{r['pattern']}` | {r['median_step_s']:.3f} | {r['min_step_s']:.3f} | "
            f"{r['max_step_s']:.3f} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mamba_cpu_train.json").write_text(
            json.dumps(dict(meta=meta, rows=rows), indent=1)
        )
        (args.out / "mamba_cpu_train.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

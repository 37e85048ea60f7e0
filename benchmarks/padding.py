"""Tokens added by the padding planner vs. padding to ``seq_length`` and to a multiple of 128.

Usage::

    python benchmarks/padding.py [--seed 0] [--micro-batches 2000] \
        [--out benchmarks/results/padding.md]

Synthetic but realistic length distributions (fixed seed, pure Python, no GPU):

* ``pretrain``: log-normal document lengths (median 700 tokens, sigma 1.1) capped at 8192, the
  usual shape of web-text documents.
* ``rl``: RL rollouts: a prompt of 64-1024 tokens plus a log-normal response (median 1200,
  sigma 1.0) capped at 16384, i.e. most rollouts short, a long tail up to the cap.

For each parallel configuration, BSHD micro-batches (``B`` rows, padded to the longest) and THD
micro-batches (sequences packed greedily up to ``seq_length``) are planned four ways. Overheads
are pad tokens added *beyond the longest row / the packed content* as a percentage of the real
tokens:

* ``planner``: this package (least valid length, docs/padding.md);
* ``+ group max``: the planner followed by the equal-count step over a TP×EP group of 8 ranks that
  hold different data (one pre-pad to the group maximum, docs/padding.md §6), what HybridEP actually
  needs (n/a without HybridEP);
* ``to 128``: round up to a multiple of 128 (THD: after the 2*cp per-sequence pad), with the share
  of micro-batches for which that is *invalid* (violates a constraint of docs/padding.md §1);
* ``to seq_length``: a fixed length (the upstream rule when PP > 1 or EP > 1).
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_hybrid.padding import bshd_pad, group_equalize, thd_pack

GROUP = 8  # ranks in the TP×EP group that dispatch to each other
BSHD_COLUMNS = ["planner", "+ group max", "to 128", "to seq_length"]
THD_COLUMNS = ["planner", "+ group max", "upstream mode", "to 128", "to seq_length"]


@dataclass(frozen=True)
class Parallel:
    name: str
    tp: int
    cp: int
    sp: bool
    quant: str | None
    hybridep: bool
    batch_size: int

    def kwargs(self) -> dict:
        return dict(tp=self.tp, cp=self.cp, sp=self.sp, quant=self.quant, hybridep=self.hybridep)


CONFIGS = (
    Parallel("tp2 sp ep8 hybridep", 2, 1, True, None, True, 4),
    Parallel("tp2 sp cp2 ep8 hybridep", 2, 2, True, None, True, 2),
    Parallel("tp1 ep8 mxfp8 hybridep", 1, 1, False, "mxfp8", True, 4),
    Parallel("tp4 sp cp2 fp8 (no hybridep)", 4, 2, True, "delayed", False, 1),
    Parallel("tp8 sp cp4 ep8 hybridep", 8, 4, True, None, True, 1),
)


def pretrain(rng: random.Random) -> int:
    return max(16, min(8192, int(rng.lognormvariate(math.log(700), 1.1))))


def rl_rollout(rng: random.Random) -> int:
    prompt = rng.randint(64, 1024)
    return min(16384, prompt + int(rng.lognormvariate(math.log(1200), 1.0)))


DISTRIBUTIONS: dict[str, tuple[Callable[[random.Random], int], int]] = {
    "pretrain": (pretrain, 8192),
    "rl": (rl_rollout, 16384),
}


def _pct(added: int, real: int) -> str:
    return f"{100 * added / real:.2f}%"


Draw = Callable[[random.Random], int]


def bshd_row(cfg: Parallel, draw: Draw, seq_len: int, n: int, rng: random.Random) -> list[str]:
    """Overheads for ``n`` BSHD micro-batches (in groups of GROUP ranks)."""
    real = planner = grouped = to128 = fixed = invalid = 0
    for _ in range(n // GROUP):
        plans, group_real = [], 0
        for _ in range(GROUP):
            rows = [draw(rng) for _ in range(cfg.batch_size)]
            cur = max(rows)
            plan = bshd_pad(cur_len=cur, batch_size=cfg.batch_size, **cfg.kwargs())
            plans.append(plan)
            group_real += sum(rows)
            planner += cfg.batch_size * (plan.padded_len - cur)
            padded128 = -(-cur // 128) * 128
            to128 += cfg.batch_size * (padded128 - cur)
            invalid += padded128 % plan.divisible_by != 0
            fixed += cfg.batch_size * (seq_len - cur)
        target = group_equalize([p.padded_len for p in plans], align=plans[0].divisible_by)
        grouped += sum(cfg.batch_size * (target - p.cur_len) for p in plans)
        real += group_real
    to128_cell = f"{_pct(to128, real)} ({100 * invalid / (n // GROUP * GROUP):.0f}% invalid)"
    group_cell = _pct(grouped, real) if cfg.hybridep else "n/a"
    return [_pct(planner, real), group_cell, to128_cell, _pct(fixed, real)]


def _bins(draw: Callable[[random.Random], int], cap: int, s: int, rng: random.Random) -> Iterator:
    """Greedy packing: add sequences while their 2*cp-padded lengths fit in ``cap``."""
    current, used = [], 0
    while True:
        n = draw(rng)
        p = -(-n // s) * s
        if current and used + p > cap:
            yield current
            current, used = [], 0
        current.append(n)
        used += p


def thd_row(cfg: Parallel, draw: Draw, seq_len: int, n: int, rng: random.Random) -> list[str]:
    """Overheads for ``n`` THD micro-batches (in groups of GROUP ranks)."""
    s = 2 * cfg.cp if cfg.cp > 1 else 1
    bins = _bins(draw, seq_len, s, rng)
    real = planner = grouped = upstream = to128 = fixed = invalid = 0
    for _ in range(n // GROUP):
        plans = []
        for _ in range(GROUP):
            lens = next(bins)
            plan = thd_pack(lens, **cfg.kwargs())
            plans.append(plan)
            real += sum(lens)
            planner += plan.total_tokens - sum(lens)
            upstream += thd_pack(lens, mode="upstream", **cfg.kwargs()).total_tokens - sum(lens)
            content = sum(-(-x // s) * s for x in lens)
            padded128 = -(-content // 128) * 128
            to128 += padded128 - sum(lens)
            invalid += padded128 % plan.total_multiple != 0
            fixed += thd_pack(lens, force_total=seq_len, **cfg.kwargs()).total_tokens - sum(lens)
        target = group_equalize([p.total_tokens for p in plans], align=plans[0].total_multiple)
        grouped += sum(target - sum(p.seqlens) for p in plans)
    to128_cell = f"{_pct(to128, real)} ({100 * invalid / (n // GROUP * GROUP):.0f}% invalid)"
    group_cell = _pct(grouped, real) if cfg.hybridep else "n/a"
    return [_pct(planner, real), group_cell, _pct(upstream, real), to128_cell, _pct(fixed, real)]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro-batches", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/padding.md"))
    args = parser.parse_args(argv)
    bshd, thd = [], []
    for dist_name, (draw, seq_len) in DISTRIBUTIONS.items():
        for cfg in CONFIGS:
            rng = random.Random(f"{args.seed}-{dist_name}-{cfg.name}")
            label = [dist_name, cfg.name]
            cells = bshd_row(cfg, draw, seq_len, args.micro_batches, rng)
            bshd.append(label + [str(cfg.batch_size)] + cells)
            thd.append(label + thd_row(cfg, draw, seq_len, args.micro_batches, rng))
    means = []
    for dist_name, (draw, seq_len) in DISTRIBUTIONS.items():
        rng = random.Random(f"{args.seed}-{dist_name}-mean")
        lengths = sorted(draw(rng) for _ in range(100_000))
        mean, median = sum(lengths) / len(lengths), lengths[len(lengths) // 2]
        means.append(f"`{dist_name}`: mean {mean:.0f}, median {median}, seq_length {seq_len}")
    command = "python benchmarks/padding.py " + " ".join(sys.argv[1:] if argv is None else argv)
    facts = [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()} ({platform.platform()}, {platform.machine()}, Python "
        f"{platform.python_version()}); pure Python, no GPU involved",
        f"- command: `{command.strip()}` (seed {args.seed}, {args.micro_batches} micro-batches "
        f"per row, TP×EP group of {GROUP} ranks holding different data)",
        "- lengths: " + "; ".join(means),
    ]
    report = "\n\n".join(
        [
            "# Padding overhead: planner vs. fixed lengths",
            "\n".join(facts),
            "Pad tokens added beyond the longest row (BSHD) or the packed content (THD), as a "
            "percentage of the real tokens. `invalid`: share of micro-batches whose "
            "multiple-of-128 length breaks a TP/SP, CP, FP8 or HybridEP constraint.",
            "## BSHD (micro-batch of B rows)",
            table(["lengths", "parallel config", "B", *BSHD_COLUMNS], bshd),
            "## THD (sequences packed up to seq_length)",
            table(["lengths", "parallel config", *THD_COLUMNS], thd),
        ]
    )
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    main()

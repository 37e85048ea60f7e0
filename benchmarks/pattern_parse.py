"""Parse time of hybrid layer patterns that expand to 1k, 10k and 100k physical layers.

Each figure is the median over ``--repeats`` parses with the parse cache cleared before every
parse, so it measures the work a first ``parse_pattern`` call does (tokenize, parse, size check,
expand, build the logical layers). Target (``docs/architecture.md``, "Guarantees and
targets"): under 50 ms at 10k layers.

Usage::

    python benchmarks/pattern_parse.py [--repeats 15] [--output benchmarks/results/pattern_parse.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from common import cpu_name

from megatron_hybrid.pattern import parse_pattern

TARGET_MS_AT_10K = 50.0


def patterns(layers: int) -> dict[str, str]:
    """Patterns of ``layers`` physical layers, written in three styles."""
    return {
        "repeated groups `[*-]{3}[*E]{n}`": f"[*-]{{3}}[*E]{{{layers // 2 - 3}}}",
        "repeated run `(M-M*-){n}`": f"(M-M*-){{{layers // 5}}}",
        "literal `*E*E...` (no repetition)": "*E" * (layers // 2),
        "literal groups `[*E][*E]...`": "[*E]" * (layers // 2),
    }


def median_ms(pattern: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        parse_pattern.cache_clear()
        start = time.perf_counter()
        parse_pattern(pattern)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="parses per figure (median)")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(__file__).parent / "results" / "pattern_parse.md",
        help="markdown file for the results",
    )
    args = parser.parse_args()

    sizes = (1_000, 10_000, 100_000)
    rows = []
    worst_10k = 0.0
    for style in patterns(sizes[0]):
        figures = []
        for size in sizes:
            pattern = patterns(size)[style]
            assert parse_pattern(pattern).physical_layer_count == size, (style, size)
            ms = median_ms(pattern, args.repeats)
            figures.append(ms)
            if size == 10_000:
                worst_10k = max(worst_10k, ms)
        rows.append((style, figures))
        print(f"{style:40s} " + "  ".join(f"{ms:8.2f} ms" for ms in figures))

    verdict = "met" if worst_10k < TARGET_MS_AT_10K else "MISSED"
    command = "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]])
    lines = [
        "# Pattern parse time",
        "",
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- machine: {cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.release()}",
        f"- load average (1 min) at the end: {os.getloadavg()[0]:.2f} (shared machine: figures "
        "include interference from other processes)",
        f"- Python {platform.python_version()} ({platform.python_implementation()})",
        f"- command: `{command}`",
        f"- method: median of {args.repeats} parses per figure, parse cache cleared before each",
        "",
        "| pattern style | 1k layers | 10k layers | 100k layers |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {style} | " + " | ".join(f"{ms:.2f} ms" for ms in f) + " |" for style, f in rows]
    lines += [
        "",
        f"Target: under {TARGET_MS_AT_10K:.0f} ms at 10k layers — {verdict} "
        f"(slowest style {worst_10k:.2f} ms).",
        "",
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines))
    print(f"wrote {args.output}")
    return 0 if verdict == "met" else 1


if __name__ == "__main__":
    raise SystemExit(main())

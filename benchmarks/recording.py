"""What a benchmark records with its results besides the figures."""

from __future__ import annotations

#: Where results live in the repository; a run's own ``--out`` folder is written as this.
RESULTS = "benchmarks/results"


def recorded_command(script: str, argv: list[str]) -> str:
    """``python benchmarks/<script> ARGS`` as run, its ``--out`` folder shown as the
    repository's results folder (a machine's output path does not belong in the record)."""
    shown = list(argv)
    for i, arg in enumerate(shown[:-1]):
        if arg == "--out":
            shown[i + 1] = RESULTS
    return " ".join([f"python benchmarks/{script}", *shown])

"""Host cost per operator when forward and backward alternate, as under combined 1F1B (one GPU).

    python benchmarks/host_overhead.py --out benchmarks/results [--pin N]

The combined-1F1B schedule runs one micro-batch's forward slots between another's backward
slots, each backward slot through its own ``torch.autograd.backward`` call; on CUDA the autograd
engine runs backward on its own device thread, so the work changes threads at every slot. The
plain schedule runs all forwards, then each micro-batch's whole backward in one call. This
benchmark runs the same operators three ways on tensors so small that the GPU waits for the
host, so the time it reports is the host's:

* ``phased`` — every micro-batch's forward, then one backward call per micro-batch (plain);
* ``split`` — per micro-batch, the forward node by node (each node's input detached), then one
  backward call per node: the calls of ``interleaved`` without the interleaving;
* ``interleaved`` — per node, the forward of micro-batch i+1, then the backward of micro-batch
  i's mirror node in its own call (combined-1F1B's order and calls).

``split - phased`` is the cost of the extra backward calls, ``interleaved - split`` that of
alternating forward and backward work. ``--pin N`` binds the process, before it starts any
thread, to N cores (N=1: the main and the engine thread share one core). Adds its rows to
``host_overhead_<device>.{json,md}`` in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import cpu_name
from ep_overlap import bind_cores
from torch import nn

MODES = ("phased", "split", "interleaved")
# The settings a results file's rows must share (the pinning may differ between rows).
_SIZES = ("nodes", "blocks", "microbatches", "hidden", "tokens", "repeats")


class Block(nn.Module):
    """Norm, linear, GELU and a residual add: a few kernels each way."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.linear(self.norm(x)))


def _node_input(x, position: int):
    # A node's input is a leaf of its own graph, except the first node's (the micro-batch, which
    # needs no gradient, as in ``phased``).
    return x if position == 0 else x.detach().requires_grad_(True)


def run_phased(nodes, inputs) -> None:
    """All forwards, then one backward call per micro-batch (the plain schedule's shape)."""
    outputs = []
    for x in inputs:
        for node in nodes:
            x = node(x)
        outputs.append(x)
    for out in outputs:
        out.sum().backward()


def _node_backward(record, grad):
    node_in, node_out = record
    torch.autograd.backward(node_out, torch.ones_like(node_out) if grad is None else grad)
    return node_in.grad


def run_split(nodes, inputs) -> None:
    """The interleaved mode's calls (a backward call per node) without the interleaving."""
    for x in inputs:
        records = []
        for position, node in enumerate(nodes):
            x = _node_input(x, position)
            records.append((x, node(x)))
            x = records[-1][1]
        grad = None
        for record in reversed(records):
            grad = _node_backward(record, grad)


def run_interleaved(nodes, inputs) -> None:
    """Per node, forward of micro-batch i+1 then backward of micro-batch i's mirror node."""
    previous = None  # [(input, output)] per node of the micro-batch whose backward is due
    for x in [*inputs, None]:
        current, grad = [], None
        for position in range(len(nodes)):
            if x is not None:
                x = _node_input(x, position)
                current.append((x, nodes[position](x)))
                x = current[-1][1]
            if previous is not None:
                grad = _node_backward(previous[len(nodes) - 1 - position], grad)
        previous = current


RUNNERS = {"phased": run_phased, "split": run_split, "interleaved": run_interleaved}


def measure(nodes, inputs, repeats: int) -> dict[str, float]:
    """Median seconds of one pass over all micro-batches, per mode, the modes taken in turn.

    Round-robin, so drift of the machine spreads over all modes; two warm-up rounds.
    """
    times = {mode: [] for mode in MODES}
    for index in range(repeats + 2):
        for mode, run in RUNNERS.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            began = time.perf_counter()
            run(nodes, inputs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if index >= 2:
                times[mode].append(time.perf_counter() - began)
    return {mode: statistics.median(t) for mode, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--nodes", type=int, default=4, help="schedule nodes (slots) per pass")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per node")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--pin", type=int, default=0,
        help="bind the process to this many cores before it starts any thread (0: leave it)",
    )  # fmt: skip
    args = parser.parse_args()
    for name in _SIZES:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.pin < 0:
        parser.error(f"--pin must be 0 or more, got {args.pin}")
    # Before CUDA and the first backward: the engine's device thread starts then and inherits it.
    cores = bind_cores(0, args.pin, parser, flag="--pin") if args.pin else []

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:  # before measuring: results of other sizes would not fit in the same table
        earlier_results(Path(args.out), device, args)
    except ValueError as error:
        parser.error(str(error))
    torch.manual_seed(0)
    nodes = nn.ModuleList(
        nn.Sequential(*(Block(args.hidden) for _ in range(args.blocks))) for _ in range(args.nodes)
    ).to(device)
    inputs = [
        torch.randn(args.tokens, args.hidden, device=device) for _ in range(args.microbatches)
    ]
    rows = []
    for mode, seconds in measure(nodes, inputs, args.repeats).items():
        per_block = seconds / (args.nodes * args.blocks * args.microbatches) * 1e6
        rows.append(dict(mode=mode, pinned_cores=len(cores), step_ms=seconds * 1e3,
                         per_block_us=per_block))  # fmt: skip
        where = f"on {len(cores)} cores" if cores else "not pinned"
        print(f"{mode:>12}, {where}: {seconds * 1e3:.2f} ms, "
              f"{per_block:.1f} us per block forward+backward", flush=True)  # fmt: skip
    write_results(Path(args.out), device, args, rows)


def _sizes(args) -> dict[str, int]:
    return {k: getattr(args, k) for k in _SIZES}


def _command(args) -> str:
    """The settings that shape the figures (not where they were written)."""
    flags = " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out")
    return f"python benchmarks/host_overhead.py {flags}"


def _results_path(out: Path, device: str) -> tuple[str, Path]:
    name = torch.cuda.get_device_name().replace(" ", "-") if device == "cuda" else "cpu"
    return name, out / f"host_overhead_{name}.json"


def earlier_results(out: Path, device: str, args) -> dict | None:
    """The results already in ``out`` for this device, if any.

    Raises:
        ValueError: they were measured with other sizes.
    """
    _, path = _results_path(out, device)
    if not path.exists():
        return None
    earlier = json.loads(path.read_text())
    sizes = _sizes(args)
    if earlier["meta"]["sizes"] != sizes:
        raise ValueError(
            f"{path} holds rows measured with {earlier['meta']['sizes']}, not {sizes}: "
            "use another --out or the same sizes"
        )
    return earlier


def write_results(out: Path, device: str, args, rows: list[dict]) -> None:
    """Add ``rows`` to ``host_overhead_<device>.{json,md}``, replacing rows of the same pinning.

    Raises:
        ValueError: the file holds rows measured with other sizes.
    """
    name, path = _results_path(out, device)
    earlier = earlier_results(out, device, args)
    kept = [r for r in earlier["rows"] if r["pinned_cores"] != args.pin] if earlier else []
    commands = earlier["meta"]["commands"] if earlier else {}
    commands[str(args.pin)] = _command(args)
    rows = sorted(kept + rows, key=lambda r: (r["pinned_cores"], MODES.index(r["mode"])))
    meta = dict(date=datetime.date.today().isoformat(), device=name, cpu=cpu_name(),
                cores=len(os.sched_getaffinity(0)), torch=torch.__version__, sizes=_sizes(args),
                commands=dict(sorted(commands.items())))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    lines = [
        f"# Host cost per block: phased, split and interleaved forward/backward, {name}", "",
        f"Date {meta['date']}; {meta['cpu']}; torch {meta['torch']}; {args.nodes} nodes of "
        f"{args.blocks} blocks (LayerNorm, Linear, GELU, add; hidden {args.hidden}, "
        f"{args.tokens} tokens), {args.microbatches} micro-batches, median of {args.repeats} "
        "passes per mode (modes round-robin). Commands: "
        + "; ".join(f"`{c}`" for c in meta["commands"].values()) + ".", "",
        "| mode | pinned cores | pass (ms) | per block fwd+bwd (us) |",
        "| --- | ---: | ---: | ---: |",
    ]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['mode']} | {r['pinned_cores'] or 'none'} | {r['step_ms']:.2f} | "
                     f"{r['per_block_us']:.1f} |")  # fmt: skip
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

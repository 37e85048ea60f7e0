"""Operators per layer of a training step, counted on the CPU: a proxy for GPU kernels per step.

    python benchmarks/op_count.py [--patterns star_e ge me plus_e] [--impl fast] [--out DIR]

A training step on one GPU at the issue's shape (``benchmarks/mfu.py``) is host-bound: every
kernel costs the CPU tens of microseconds of Python, dispatcher and launch time, so a step's
time follows its kernel count. This script counts, with torch.profiler on the CPU, the aten
operators that would launch a kernel (leaf operators, less the ones that only make views or
allocate) in one ``train`` step, built and run as ``mfu.py`` runs it (``train``'s model in
megatron's DDP, its optimizer and step), at a tiny width but with the issue's 64 experts
(top-8), so loops over experts show. Per logical layer is the difference between a two-layer
and a one-layer model (the embedding, output layer and loss cancel), counted for a micro-batch
after the first (the first one's weight gradients need no accumulation; the optimizer's work,
the same for any number of micro-batches, cancels too): ``(two layers - one layer)`` at two
micro-batches minus the same at one. The operators that differ most are listed.

What a CPU count does not see: GPU-only code (fla's Triton kernels for ``G``, which the CPU
replaces by torch code; ``torch.compile``'s fused kernels for ``M``, disabled on the CPU), and
CUDA-only copies (``.to(device)``). Writes ``op_count_<impl>.json`` into ``--out`` when given.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

#: Operators that only create views, reshape metadata or allocate: no kernel of their own.
NO_KERNEL = frozenset(
    "aten::" + name
    for name in (
        "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "expand", "expand_as",
        "transpose", "t", "permute", "squeeze", "unsqueeze", "slice", "select", "narrow",
        "split", "split_with_sizes", "chunk", "unbind", "detach", "detach_", "alias",
        "view_as", "unflatten", "flatten", "empty", "empty_like", "empty_strided",
        "resolve_conj", "resolve_neg", "lift_fresh", "_to_copy_meta", "result_type",
        "is_nonzero", "item", "_local_scalar_dense", "size", "stride", "numel", "dim",
        "movedim", "swapaxes", "unfold", "diagonal", "real", "imag", "contiguous", "to",
        "_has_compatible_shallow_copy_type", "set_", "_nested_tensor_from_mask",
        "requires_grad_", "retain_grad", "output_nr", "_version", "is_same_size", "numpy_T",
        "new_empty", "new_empty_strided", "mT", "mH", "adjoint", "conj", "view_as_real",
    )
)  # fmt: skip

#: Operators that are one kernel on a GPU but loop on the CPU, counted once, their callees not
#: at all: ``torch._grouped_mm`` (one ``mm`` per group on the CPU) and ``torch._foreach_add_``
#: (the grouped experts' weight-gradient add: one multi-tensor kernel, or on CUDA with float32
#: ``main_grad`` the package's one Triton kernel instead).
ONE_KERNEL = frozenset({"aten::_grouped_mm", "aten::_foreach_add_"})

SHAPE = dict(layers=1, hidden=64, heads=4, experts=64, topk=8, expert_hidden=32, seq=4096, mbs=1,
             microbatches=1, vocab=256, gdn_heads=2, gdn_head_dim=16, mamba_state=16,
             mamba_head_dim=16, mamba_groups=2, q_lora_rank=None, kv_lora_rank=32,
             qk_head_dim=16, qk_rope_dim=8, v_head_dim=16)  # fmt: skip


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


_SCALAR_CASTS = frozenset(("aten::to", "aten::_to_copy", "aten::copy_", "aten::fill_"))


def _kernel_like(event) -> bool:
    """An aten operator that would launch a kernel: not a view or allocation, and not a
    copy of a Python scalar into a tensor (0-dimensional, made on the host; ``record_shapes``
    gives the shapes, without them every copy counts)."""
    if not event.name.startswith("aten::") or event.name in NO_KERNEL:
        return False
    shapes = getattr(event, "input_shapes", None)
    scalar = event.name in _SCALAR_CASTS and shapes and not any(shapes)
    return not scalar


def kernel_ops(events) -> collections.Counter:
    """Aten operators of a profile that launch work, by name: the lowest ones of each call
    tree (an operator whose callees launch nothing counts once; one that calls launching
    operators counts as those)."""
    launches: dict[int, bool] = {}

    def launching(event) -> bool:
        key = id(event)
        if key not in launches:
            if event.name in ONE_KERNEL:
                launches[key] = True
                return True
            below = [launching(child) for child in event.cpu_children]
            launches[key] = any(below) or _kernel_like(event)
        return launches[key]

    counts: collections.Counter = collections.Counter()
    for event in events:
        if _kernel_like(event):
            inside_one = any(p.name in ONE_KERNEL for p in _ancestors(event))
            if inside_one:
                continue
            if event.name in ONE_KERNEL or not any(launching(c) for c in event.cpu_children):
                counts[event.name] += 1
    return counts


def count_step(pattern: str, layers: int, microbatches: int, impl: str) -> collections.Counter:
    """Kernel-launching operators of one ``train`` step (after a warm-up step) of ``pattern``:
    ``train``'s model chunks in megatron's DDP, its optimizer and step function
    (``benchmarks/mfu.py``'s :class:`Run`), every sequence ``seq`` long; ``G`` on the fast
    path's torch scan (fla's kernels need a GPU)."""
    from mfu import Run, build_parser
    from torch.profiler import ProfilerActivity, profile

    shape = SimpleNamespace(**{**SHAPE, "layers": layers, "microbatches": microbatches})
    # mfu.py's defaults (train's parameter order and fusions), every sequence full, G's scan.
    args = build_parser().parse_args(["--data", "full", "--gdn-kernel", "torch"])
    args.warmup, args.steps, args.ep = 1, 1, 1
    run = Run(args, shape, pattern, impl)
    try:
        run.step(run.batches())
        batches = run.batches()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            run.step(batches)
        return kernel_ops(prof.events())
    finally:
        run.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patterns", nargs="+", default=["star_e", "ge", "me", "plus_e"],
                        choices=["star_e", "ge", "me", "plus_e"])  # fmt: skip
    parser.add_argument("--impl", default="fast", choices=["fast", "reference"])
    parser.add_argument("--top", type=int, default=12, help="operators listed per pattern")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from megatron_hybrid.process_groups import init_single_process_world
    from megatron_hybrid.runtime import select_backend

    torch.set_num_threads(1)
    select_backend("cpu").activate()
    init_single_process_world("gloo")
    results = {}
    for pattern in args.patterns:
        runs = {(layers, mbs): count_step(pattern, layers, mbs, args.impl)
                for layers in (1, 2) for mbs in (1, 2)}  # fmt: skip
        per_layer = runs[2, 2].copy()
        for key, sign in (((1, 2), -1), ((2, 1), -1), ((1, 1), 1)):
            per_layer.update({n: sign * c for n, c in runs[key].items()})
        total = sum(per_layer.values())
        top = [(n, c) for n, c in per_layer.most_common(args.top) if c]
        step = sum(runs[1, 1].values())
        results[pattern] = {"per_layer": total, "step_one_layer": step, "top": top}
        print(
            f"{pattern:7s} {args.impl}: {total} operators per "
            f"logical layer and micro-batch (forward + backward); one-layer step {step}"
        )
        for name, count in top:
            print(f"    {count:5d}  {name}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"op_count_{args.impl}.json").write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

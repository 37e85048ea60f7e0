"""Where a profiled training step spends its time, from a torch.profiler Chrome trace.

The EP-overlap question is whether a slower overlapped step comes from the GPU doing more work
(kernels slowed by running next to NCCL's) or from the GPU waiting (for the CPU to launch work,
for a host synchronisation). The summary separates the two for one rank:

* ``gpu_busy_ms`` — the union of all kernel and copy intervals, ``gpu_idle_ms`` the rest of the
  step window;
* ``compute_busy_ms`` / ``comm_busy_ms`` — unions of non-NCCL and of NCCL kernels, and
  ``comm_hidden_ms`` the time NCCL kernels were resident alongside compute kernels. Resident, not
  transferring: an NCCL kernel launched early waits for its peers on the GPU, so under overlap
  ``comm_busy_ms`` includes that waiting and can exceed the plain schedule's NCCL time;
* ``compute_kernel_sum_ms`` — summed durations of the non-NCCL kernels (grows if they slow down);
* ``cpu_op_busy_ms`` — the union of the CPU operator intervals of all threads (the forward
  thread and autograd's device thread): host time spent inside operators, ``cpu_ops`` their
  number (nested ones included);
* ``cpu_sync_wait_ms`` — CPU time blocked in stream/event synchronisation (device-wide syncs
  excluded: the benchmark ends each step with one);
* ``cpu_outside_ms`` — the window's time in neither an operator nor a synchronisation: Python
  and the framework's own bookkeeping;
* ``cpu_launch_ms`` — CPU time in kernel launch calls, with their count, the median call in
  microseconds, and ``driver_launches``, those made through the driver API (Triton's kernels,
  torch.compile's included).

Intervals are clipped to the step window; counts and summed durations take the events that start
in it. A step whose GPU idles while its CPU hardly waits is host-bound: the CPU cannot issue the
work fast enough, and hiding communication cannot shorten it.

    python benchmarks/trace_summary.py trace.json[.gz] [--window-name mh_step]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import traceback
import warnings
from collections.abc import Iterable

__all__ = [
    "KERNEL_CATEGORIES",
    "interval_union",
    "intersection_length",
    "kernel_breakdown",
    "kernel_category",
    "load_trace_events",
    "profile_call",
    "record_trace",
    "summarize_trace",
    "sync_sites",
]

_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_SYNC_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cuEventSynchronize",
               "cuStreamSynchronize")  # fmt: skip
_DRIVER_LAUNCHES = ("cuLaunchKernel", "cuLaunchKernelEx")
_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", *_DRIVER_LAUNCHES)


def interval_union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted ``(start, end)`` intervals covering the same points.

    >>> interval_union([(5, 7), (0, 2), (1, 3), (7, 8)])
    [(0, 3), (5, 8)]
    """
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length covered by both of two merged interval lists.

    >>> intersection_length([(0, 4), (6, 10)], [(2, 7)])
    3
    """
    i = j = 0
    total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _clip(
    intervals: Iterable[tuple[float, float]], window: tuple[float, float]
) -> list[tuple[float, float]]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def summarize_trace(events: list[dict], window_name: str = "mh_step") -> dict:
    """Summary of one step of a Chrome trace's ``traceEvents`` (times in ms).

    Args:
        events: the trace's complete events (``ph == "X"``); others are ignored.
        window_name: name of the CPU annotation (``torch.profiler.record_function``) that spans
            the step. Without one, the span of all GPU events is the window.

    Raises:
        ValueError: the trace holds no GPU kernels (profiled without CUDA activity).
    """
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in complete if e.get("cat") in _GPU_CATEGORIES]
    if not any(e.get("cat") == "kernel" for e in gpu):
        raise ValueError("the trace has no GPU kernels; profile with ProfilerActivity.CUDA")
    marks = [e for e in complete if e.get("name") == window_name]
    if marks:
        window = (min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks))
    else:
        window = (min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu))

    def inside(selected: Iterable[dict]) -> list[dict]:
        return [e for e in selected if window[0] <= e["ts"] < window[1]]

    def spans(selected: Iterable[dict]) -> list[tuple[float, float]]:
        return interval_union(_clip([(e["ts"], e["ts"] + e["dur"]) for e in selected], window))

    kernels = inside(e for e in gpu if e.get("cat") == "kernel")
    nccl = [e for e in kernels if "nccl" in e.get("name", "").lower()]
    compute = [e for e in kernels if "nccl" not in e.get("name", "").lower()]
    busy = spans(gpu)
    comm = spans(e for e in gpu if "nccl" in e.get("name", "").lower())
    comp = spans(e for e in gpu if e.get("cat") == "kernel" and "nccl" not in e["name"].lower())
    ops = inside(e for e in complete if e.get("cat") == "cpu_op")
    runtime = inside(e for e in complete if e.get("cat") in ("cuda_runtime", "cuda_driver"))
    syncs = [e for e in runtime if e.get("name") in _SYNC_CALLS]
    launches = [e for e in runtime if e.get("name") in _LAUNCH_CALLS]
    host = spans(ops + syncs)
    ms = 1e-3  # trace times are microseconds
    window_len = window[1] - window[0]
    return {
        "window_ms": window_len * ms,
        "gpu_busy_ms": _length(busy) * ms,
        "gpu_idle_ms": (window_len - _length(busy)) * ms,
        "compute_busy_ms": _length(comp) * ms,
        "comm_busy_ms": _length(comm) * ms,
        "comm_hidden_ms": intersection_length(comm, comp) * ms,
        "compute_kernel_sum_ms": sum(e["dur"] for e in compute) * ms,
        "compute_kernels": len(compute),
        "nccl_kernels": len(nccl),
        "cpu_op_busy_ms": _length(spans(ops)) * ms,
        "cpu_ops": len(ops),
        "cpu_sync_wait_ms": sum(e["dur"] for e in syncs) * ms,
        "cpu_syncs": len(syncs),
        "cpu_outside_ms": (window_len - _length(host)) * ms,
        "cpu_launch_ms": sum(e["dur"] for e in launches) * ms,
        "cpu_launches": len(launches),
        "cpu_launch_median_us": statistics.median(e["dur"] for e in launches) if launches else 0.0,
        "driver_launches": sum(1 for e in launches if e["name"] in _DRIVER_LAUNCHES),
    }


#: (category, lower-case name fragments), tried in order; a kernel that matches none and is not
#: a C++ kernel (no ``void`` / ``::`` in its name) is a Triton kernel (inductor's ``triton_*``,
#: fla's), else ``other``.
KERNEL_CATEGORIES = (
    ("nccl", ("nccl",)),
    ("memory", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "groupmm", "grouped_mm")),
    ("triton", ("triton_",)),
    ("reduction", ("reduce", "softmax", "norm", "cross_entropy", "cumsum", "scan")),
    ("memory", ("copy", "cat", "index", "scatter", "gather", "sort", "radix")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_category(name: str) -> str:
    """The category of a GPU kernel name (:data:`KERNEL_CATEGORIES`).

    >>> kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64")
    'gemm'
    >>> kernel_category("void at::native::vectorized_elementwise_kernel<4, ...>")
    'elementwise'
    >>> kernel_category("chunk_gated_delta_rule_fwd_kernel_h_blockdim64")
    'triton'
    """
    lower = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(fragment in lower for fragment in fragments):
            return category
    if "::" not in name and not lower.startswith("void"):
        return "triton"
    return "other"


def kernel_breakdown(events: list[dict], window_name: str = "mh_step", top: int = 15) -> dict:
    """Where the GPU time of one profiled step goes, kernel by kernel (times in ms).

    Returns ``{"categories": {category: {"ms", "count"}}, "kernels": [{"name", "category",
    "ms", "count", "mean_us"}, ...]}`` for the GPU events (kernels, copies, memsets) that start
    in the step window, the ``top`` kernels by summed time first, names cut to 120 characters.
    """
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in complete if e.get("cat") in _GPU_CATEGORIES]
    marks = [e for e in complete if e.get("name") == window_name]
    if marks:
        window = (min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks))
    elif gpu:
        window = (min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu))
    else:
        return {"categories": {}, "kernels": []}
    per_name: dict[str, list[float]] = {}
    for e in gpu:
        if window[0] <= e["ts"] < window[1]:
            per_name.setdefault(e.get("name", "?"), []).append(e["dur"])
    categories: dict[str, dict] = {}
    kernels = []
    for name, durations in per_name.items():
        category = kernel_category(name)
        total = sum(durations)
        entry = categories.setdefault(category, {"ms": 0.0, "count": 0})
        entry["ms"] += total * 1e-3
        entry["count"] += len(durations)
        kernels.append({"name": name[:120], "category": category, "ms": total * 1e-3,
                        "count": len(durations), "mean_us": total / len(durations)})  # fmt: skip
    kernels.sort(key=lambda k: -k["ms"])
    ordered = dict(sorted(categories.items(), key=lambda kv: -kv[1]["ms"]))
    return {"categories": ordered, "kernels": kernels[:top]}


def load_trace_events(path: str) -> list[dict]:
    """The events of a Chrome trace file, plain or gzipped (``.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def record_trace(call, sync):
    """``call()`` once under torch.profiler (CPU and CUDA activity) in an ``mh_step`` window
    ended by ``sync()``: the profiler and its Chrome trace as JSON text."""
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("mh_step"):
            call()
            sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return prof, path.read_text()


def profile_call(call, sync, *, top: int = 15) -> tuple[dict, dict, list[dict]]:
    """``call()`` once under :func:`record_trace`: its :func:`summarize_trace`, its
    :func:`kernel_breakdown` and the ``top`` CPU operators by their own (self) host time,
    ``[{"name", "self_cpu_ms", "count"}, ...]``."""
    prof, text = record_trace(call, sync)
    events = json.loads(text)["traceEvents"]
    averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
    host = [
        {"name": a.key[:120], "self_cpu_ms": a.self_cpu_time_total * 1e-3, "count": a.count}
        for a in averages
        if a.key != "mh_step"
    ][:top]
    return summarize_trace(events), kernel_breakdown(events, top=top), host


#: Source folders whose frames name a synchronisation's site.
_OWN_FRAMES = ("/megatron_hybrid/", "/megatron/core/", "/fla/")


def _short(frame) -> str:
    name = frame.filename
    for folder in _OWN_FRAMES:
        if folder in name:
            name = folder.strip("/") + "/" + name.split(folder)[-1]
    return f"{name}:{frame.lineno}"


def sync_sites(call, *, top: int = 12) -> list[dict]:
    """``call()`` once with torch's CUDA sync debug mode on: every operation that synchronises
    the host with the GPU (``.item()``, ``.tolist()``, a copy to the host, ``nonzero``, ...)
    counted by its site, ``[{"site", "count"}, ...]``, most frequent first.

    A site is the innermost frame of this package, megatron-core or fla that led to the
    operator (a sync inside torch's own Python names the caller that asked for it), with this
    package's innermost frame after it where that is another one.
    """
    import torch

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if any(folder in f.filename for folder in _OWN_FRAMES)]  # fmt: skip
        if not frames:
            sites[f"{filename}:{lineno}"] += 1
            return
        site = _short(frames[-1])
        ours = [f for f in frames if _OWN_FRAMES[0] in f.filename]
        if ours and ours[-1] is not frames[-1]:
            site += f" (from {_short(ours[-1])})"
        sites[site] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [{"site": site, "count": n} for site, n in sites.most_common(top)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="Chrome trace JSON written by torch.profiler (.json[.gz])")
    parser.add_argument("--window-name", default="mh_step")
    args = parser.parse_args()
    try:
        summary = summarize_trace(load_trace_events(args.trace), args.window_name)
    except (OSError, ValueError, KeyError) as error:  # JSONDecodeError is a ValueError
        parser.error(f"{args.trace}: {error}")
    for key, value in summary.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")


if __name__ == "__main__":
    main()

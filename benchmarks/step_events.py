"""What a step did besides its own work: the host-side events that make one step slow where the
others are not.

A median hides steps that pay work the others do not: at EP 4 on 4 x H200 (``docs/
performance.md``) one timed step in four or five took 1.9 s against 0.38 s, and at EP > 1 the
ranks wait for the slowest in every all-to-all, so one rank's pause is everyone's. The per-rank,
per-step counts here say which rank paid what, for the candidates that are the host's and can be
counted without a profiler:

* Python's garbage collector (``gc.callbacks``): collections of the oldest generation, which
  walk every tracked object of the process, and the time of all collections;
* Triton kernels compiled or loaded from the disk cache (Triton's
  ``knobs.runtime.jit_post_compile_hook``, Triton >= 3.4): a specialisation of a ``triton.jit``
  kernel (fla's, the package's) met for the first time (an argument's divisibility, an
  autotuner's new key). Inductor compiles its generated kernels without that hook; they come
  with a TorchDynamo graph, counted next;
* TorchDynamo graphs compiled (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``) and
  the seconds of the package's compiled pieces (``CompiledPiece``'s ``COMPILE_SECONDS``);
* the CUDA caching allocator's calls to the driver (``torch.cuda.memory_stats``:
  ``num_device_alloc``, ``num_device_free``) and its retries after freeing its cache
  (``num_alloc_retries``: each one synchronises the device and frees every cached block).

A step with none of these and still slow on every rank waited for something else: the device (a
kernel slower for some shapes) or another rank's device.
"""

from __future__ import annotations

import gc
import time

import torch

__all__ = ["EVENT_KEYS", "StepEvents", "event_lines", "event_text"]

#: The counted events, in the order the tables show them.
EVENT_KEYS = (
    "gc_full",
    "gc_ms",
    "triton_kernels",
    "dynamo_graphs",
    "compile_s",
    "cuda_mallocs",
    "cuda_frees",
    "alloc_retries",
)

#: ``torch.cuda.memory_stats`` keys behind the allocator's events.
_ALLOCATOR_STATS = {
    "cuda_mallocs": "num_device_alloc",
    "cuda_frees": "num_device_free",
    "alloc_retries": "num_alloc_retries",
}


def _triton_runtime_knobs():
    """Triton's runtime knobs where this Triton has the post-compile hook, else None."""
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one older than its knobs (3.4)
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if hasattr(runtime, "jit_post_compile_hook") else None


class StepEvents:
    """Counts the events of :data:`EVENT_KEYS` while open; :meth:`mark` returns those since the
    previous mark.

    A context manager: it adds a ``gc`` callback and chains Triton's post-compile hook (a hook
    set before keeps being called, and is put back on exit). Counts it cannot take on this
    machine (no CUDA, no Triton hook) are None.

    Args:
        cuda: whether to read the CUDA allocator's statistics (default: CUDA is available).
    """

    def __init__(self, cuda: bool | None = None):
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._gc_full = 0
        self._gc_seconds = 0.0
        self._gc_began: float | None = None
        self._triton_kernels = 0
        self._runtime = None
        self._chained = None
        self._last: dict | None = None

    # -- collectors ---------------------------------------------------------------------------

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
            return
        if self._gc_began is not None:
            self._gc_seconds += time.perf_counter() - self._gc_began
            self._gc_began = None
        if info.get("generation") == 2:
            self._gc_full += 1

    def _on_compiled(self, *args, **kwargs):
        self._triton_kernels += 1
        if self._chained is not None:
            return self._chained(*args, **kwargs)
        return None

    def __enter__(self) -> StepEvents:
        gc.callbacks.append(self._on_gc)
        self._runtime = _triton_runtime_knobs()
        if self._runtime is not None:
            self._chained = self._runtime.jit_post_compile_hook
            self._runtime.jit_post_compile_hook = self._on_compiled
        self._last = self._totals()
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        if self._runtime is not None:
            # Put back what was there, unless somebody replaced our hook meanwhile.
            if self._runtime.jit_post_compile_hook == self._on_compiled:
                self._runtime.jit_post_compile_hook = self._chained
            self._runtime = self._chained = None

    # -- reading ------------------------------------------------------------------------------

    def _totals(self) -> dict:
        from megatron_hybrid.modules.fast.compiled import COMPILE_SECONDS

        totals: dict = {
            "gc_full": self._gc_full,
            "gc_ms": 1e3 * self._gc_seconds,
            "triton_kernels": self._triton_kernels if self._runtime is not None else None,
            "dynamo_graphs": _dynamo_graphs(),
            "compile_s": sum(COMPILE_SECONDS.values()),
        }
        stats = torch.cuda.memory_stats() if self.cuda else {}
        for key, stat in _ALLOCATOR_STATS.items():
            totals[key] = stats.get(stat) if self.cuda else None
        return totals

    def mark(self) -> dict:
        """The events since the previous mark (or since the context opened)."""
        if self._last is None:
            raise RuntimeError("StepEvents.mark() outside its context")
        now, last = self._totals(), self._last
        self._last = now
        return {
            key: None if now[key] is None or last[key] is None else now[key] - last[key]
            for key in EVENT_KEYS
        }


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def event_text(events: dict) -> str:
    """One step's events in a table cell: only what happened, e.g. ``full gc 1 (412 ms);
    Triton kernels 3``; ``-`` for none."""
    parts = []
    if events.get("gc_full"):
        parts.append(f"full gc {events['gc_full']}")
    if (events.get("gc_ms") or 0.0) >= 1.0:
        parts.append(f"gc {events['gc_ms']:.0f} ms")
    labels = (
        ("triton_kernels", "Triton kernels"),
        ("dynamo_graphs", "dynamo graphs"),
        ("cuda_mallocs", "cudaMalloc"),
        ("cuda_frees", "cudaFree"),
        ("alloc_retries", "allocator retries"),
    )
    parts += [f"{label} {events[key]}" for key, label in labels if events.get(key)]
    if (events.get("compile_s") or 0.0) > 0.0:
        parts.append(f"compiled {events['compile_s']:.1f} s")
    return "; ".join(parts) or "-"


def event_lines(results: dict) -> list[str]:
    """A table of every timed step's time and events per rank (rank 0's alone in a run of one
    process), for the runs that counted them: a slow step's cause is in its row."""
    rows = []
    for run, result in results.items():
        ranks = result.get("ranks") or [{"rank": 0, **result}]
        if any(not rank.get("step_events") for rank in ranks):
            continue
        for step in range(len(ranks[0]["steps_s"])):
            cells = [f"{rank['steps_s'][step]:.3f} s: {event_text(rank['step_events'][step])}"
                     for rank in ranks]  # fmt: skip
            rows.append((run, step, cells))
    if not rows:
        return []
    width = max(len(cells) for _, _, cells in rows)
    lines = ["", "Each timed step on each rank: its time and what else it did (full garbage "
             "collections, Triton kernels compiled or loaded, TorchDynamo graphs, the CUDA "
             "allocator's cudaMalloc / cudaFree calls and retries; `-`: none of them):", "",
             "| run | step | " + " | ".join(f"rank {r}" for r in range(width)) + " |",
             "| --- | ---: |" + " --- |" * width]  # fmt: skip
    for run, step, cells in rows:
        cells += [""] * (width - len(cells))
        lines.append(f"| {run} | {step} | " + " | ".join(cells) + " |")
    return lines

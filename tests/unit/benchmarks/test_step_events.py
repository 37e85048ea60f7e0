"""benchmarks/step_events.py: each step's garbage collections, Triton kernels, TorchDynamo graphs
and CUDA allocator calls, counted between marks."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import step_events  # noqa: E402
from step_events import EVENT_KEYS, StepEvents, event_lines, event_text  # noqa: E402


def test_collections_are_counted_in_the_step_they_happen():
    with StepEvents(cuda=False) as events:
        gc.collect()  # before the mark: not the step's
        events.mark()
        gc.collect()
        gc.collect(0)  # a young collection: time, not a full one
        gc.collect()
        step = events.mark()
        after = events.mark()
    assert step["gc_full"] == 2 and step["gc_ms"] > 0.0
    assert after["gc_full"] == 0 and after["gc_ms"] == 0.0
    assert all(callback.__self__ is not events for callback in gc.callbacks
               if hasattr(callback, "__self__"))  # fmt: skip


DYNAMO_CHILD = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from step_events import StepEvents

compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
with StepEvents(cuda=False) as events:
    compiled(torch.ones(3))
    first = events.mark()
    compiled(torch.ones(3))  # the same shape: the cached graph
    again = events.mark()
print(first["dynamo_graphs"], again["dynamo_graphs"])
"""


def test_dynamo_graphs_count_compilations_not_calls():
    # In a process of its own: the CPU runtime back-end, which other tests of this process may
    # have activated, turns TorchDynamo off for good (runtime/cpu.py).
    import subprocess

    benchmarks = Path(__file__).resolve().parents[3] / "benchmarks"
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    done = subprocess.run([sys.executable, "-c", DYNAMO_CHILD, str(benchmarks)],
                          capture_output=True, text=True, timeout=300, env=env,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "0"]  # one graph compiled, none for the second call


def test_triton_hook_counts_and_chains_to_the_hook_before():
    knobs = step_events._triton_runtime_knobs()
    if knobs is None:
        pytest.skip("this Triton has no knobs.runtime.jit_post_compile_hook (Triton < 3.4)")
    seen = []

    def before(**kwargs):
        seen.append(kwargs["key"])

    saved = knobs.jit_post_compile_hook
    knobs.jit_post_compile_hook = before
    try:
        with StepEvents(cuda=False) as events:
            assert knobs.jit_post_compile_hook != before
            # What Triton's JITFunction does after compiling or loading a specialisation.
            knobs.jit_post_compile_hook(key="a", already_compiled=False)
            knobs.jit_post_compile_hook(key="b", already_compiled=False)
            step = events.mark()
            idle = events.mark()
        assert step["triton_kernels"] == 2 and idle["triton_kernels"] == 0
        assert seen == ["a", "b"]  # the hook set before still sees every kernel
        assert knobs.jit_post_compile_hook is before  # and is put back
    finally:
        knobs.jit_post_compile_hook = saved


def test_allocator_calls_are_differences_of_cuda_statistics(monkeypatch):
    stats = iter([
        {"num_device_alloc": 10, "num_device_free": 4, "num_alloc_retries": 0},
        {"num_device_alloc": 13, "num_device_free": 4, "num_alloc_retries": 1},
    ])  # fmt: skip
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: next(stats))
    with StepEvents(cuda=True) as events:
        step = events.mark()
    assert (step["cuda_mallocs"], step["cuda_frees"], step["alloc_retries"]) == (3, 0, 1)
    with StepEvents(cuda=False) as events:  # no CUDA: not counted, not zero
        step = events.mark()
    assert step["cuda_mallocs"] is None and step["alloc_retries"] is None


def test_mark_outside_the_context_is_an_error():
    with pytest.raises(RuntimeError, match=r"mark\(\) outside its context"):
        StepEvents(cuda=False).mark()


def _events(**given):
    return {key: given.get(key, 0) for key in EVENT_KEYS}


@pytest.mark.parametrize(
    ("events", "text"),
    [
        (_events(), "-"),
        (_events(gc_ms=0.4), "-"),  # young collections under a millisecond: not worth a word
        (_events(gc_full=1, gc_ms=412.3), "full gc 1; gc 412 ms"),
        (_events(triton_kernels=3, cuda_mallocs=2, alloc_retries=1),
         "Triton kernels 3; cudaMalloc 2; allocator retries 1"),
        (_events(compile_s=2.5, dynamo_graphs=1), "dynamo graphs 1; compiled 2.5 s"),
        ({**_events(), "cuda_mallocs": None, "triton_kernels": None}, "-"),
    ],
    ids=["none", "young-gc", "full-gc", "triton-and-allocator", "compiled", "not-counted"],
)  # fmt: skip
def test_event_text(events, text):
    assert event_text(events) == text


def test_event_lines_give_each_rank_a_column_and_each_step_a_row():
    quiet, busy = _events(), _events(gc_full=1, gc_ms=950.0)
    results = {
        "star_e/fast": {
            "steps_s": [0.4, 1.9],
            "step_events": [quiet, busy],
            "ranks": [
                {"rank": 0, "steps_s": [0.4, 1.9], "step_events": [quiet, quiet]},
                {"rank": 1, "steps_s": [0.4, 1.9], "step_events": [quiet, busy]},
            ],
        },
        "ge/fast": {"steps_s": [0.5], "step_events": []},  # nothing counted: no rows
    }
    lines = event_lines(results)
    assert lines[3] == "| run | step | rank 0 | rank 1 |"
    assert lines[5:] == [
        "| star_e/fast | 0 | 0.400 s: - | 0.400 s: - |",
        "| star_e/fast | 1 | 1.900 s: - | 1.900 s: full gc 1; gc 950 ms |",
    ]
    single = event_lines({"star_e/fast": {"steps_s": [0.4], "step_events": [busy]}})
    assert single[3] == "| run | step | rank 0 |"
    assert single[5] == "| star_e/fast | 0 | 0.400 s: full gc 1; gc 950 ms |"
    assert event_lines({"ge/fast": {"steps_s": [0.5], "step_events": []}}) == []

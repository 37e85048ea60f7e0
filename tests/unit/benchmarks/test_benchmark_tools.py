"""The pure parts of the benchmark scripts: trace summaries, round merging, host-overhead modes."""

from __future__ import annotations

import doctest
import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("trace_summary"), importlib.import_module("ep_overlap")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_doctests(tools):
    for module in tools:
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


@pytest.mark.parametrize(
    "intervals, expected",
    [
        ([], []),
        ([(0, 1)], [(0, 1)]),
        ([(3, 4), (0, 1)], [(0, 1), (3, 4)]),
        ([(0, 5), (1, 2)], [(0, 5)]),
        ([(0, 2), (2, 3)], [(0, 3)]),
    ],
    ids=["empty", "one", "unsorted-disjoint", "nested", "touching"],
)
def test_interval_union(tools, intervals, expected):
    assert tools[0].interval_union(intervals) == expected


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ([(0, 10)], [(2, 3), (5, 7)], 3),
        ([(0, 1)], [(1, 2)], 0),
        ([(0, 4), (6, 10)], [(3, 7)], 2),
        ([], [(0, 1)], 0),
    ],
    ids=["inside", "touching", "straddling-gap", "empty"],
)
def test_intersection_length(tools, a, b, expected):
    assert tools[0].intersection_length(a, b) == expected


def _event(name, cat, ts, dur, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def test_summarize_trace_separates_busy_idle_and_hidden_communication(tools):
    events = [
        _event("mh_step", "user_annotation", 0, 100),
        _event("gemm", "kernel", 10, 30, stream=7),
        _event("elementwise", "kernel", 50, 10, stream=7),
        _event("ncclDevKernel_SendRecv", "kernel", 30, 25, stream=20),
        _event("Memcpy DtoH", "gpu_memcpy", 70, 5, stream=21),
        _event("cudaEventSynchronize", "cuda_runtime", 20, 12),
        _event("cudaDeviceSynchronize", "cuda_runtime", 80, 20),  # the step's own final sync
        _event("cudaLaunchKernel", "cuda_runtime", 1, 1),
        _event("cuLaunchKernelEx", "cuda_driver", 2, 2),
        _event("late kernel", "kernel", 120, 10, stream=7),  # outside the step window
        _event("aten::mm", "cpu_op", 0, 10),  # forward thread
        _event("aten::mm", "cpu_op", 5, 10, tid=2),  # autograd's device thread, overlapping
        _event("aten::add", "cpu_op", 40, 5),
        _event("early kernel", "kernel", -10, 15, stream=7),  # straddles the window's start
        {"ph": "i", "name": "marker", "ts": 5},  # not a complete event
    ]
    s = tools[0].summarize_trace(events)
    assert s["window_ms"] == pytest.approx(0.1)
    assert s["gpu_busy_ms"] == pytest.approx(0.060)  # [0, 5] (clipped), [10, 60] and [70, 75]
    assert s["gpu_idle_ms"] == pytest.approx(0.040)
    assert s["compute_busy_ms"] == pytest.approx(0.045)
    assert s["comm_busy_ms"] == pytest.approx(0.025)
    assert s["comm_hidden_ms"] == pytest.approx(0.015)  # [30, 40] and [50, 55]
    # Counts and sums take the kernels that start in the window.
    assert s["compute_kernel_sum_ms"] == pytest.approx(0.040)
    assert (s["compute_kernels"], s["nccl_kernels"]) == (2, 1)
    assert (s["cpu_sync_wait_ms"], s["cpu_syncs"]) == (pytest.approx(0.012), 1)
    assert (s["cpu_launch_ms"], s["cpu_launches"]) == (pytest.approx(0.003), 2)
    assert s["cpu_launch_median_us"] == pytest.approx(1.5)
    assert s["driver_launches"] == 1
    assert s["cpu_op_busy_ms"] == pytest.approx(0.020)  # [0, 15] and [40, 45]
    assert s["cpu_ops"] == 3
    # Neither in an operator nor in a sync: [15, 20], [32, 40], [45, 100] (the device sync is
    # not a stream/event sync).
    assert s["cpu_outside_ms"] == pytest.approx(0.068)


def test_summarize_trace_without_annotation_uses_the_gpu_span(tools):
    events = [_event("k", "kernel", 10, 5), _event("k", "kernel", 25, 5)]
    s = tools[0].summarize_trace(events, window_name="absent")
    assert s["window_ms"] == pytest.approx(0.020)
    assert s["gpu_idle_ms"] == pytest.approx(0.010)


def test_trace_files_load_plain_or_gzipped(tools, tmp_path):
    import gzip
    import json

    events = [_event("k", "kernel", 0, 5)]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    with gzip.open(tmp_path / "t.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    for name in ("t.json", "t.json.gz"):
        assert tools[0].load_trace_events(str(tmp_path / name)) == events


def test_summarize_trace_refuses_a_trace_without_kernels(tools):
    with pytest.raises(ValueError, match="no GPU kernels"):
        tools[0].summarize_trace([_event("aten::mm", "cpu_op", 0, 5)])


def test_rounds_merge_and_pair_by_round(tools):
    ep_overlap = tools[1]
    plain = [{"median_s": 1.2, "steps_s": [1.2], "peak_gib": 1.0},
             {"median_s": 1.0, "steps_s": [1.0], "peak_gib": 1.1}]  # fmt: skip
    overlap = [{"median_s": 1.0, "steps_s": [1.0], "peak_gib": 2.0},
               {"median_s": 1.0, "steps_s": [1.0], "peak_gib": 2.0}]  # fmt: skip
    results = {
        "gpt_plain": ep_overlap.merge_rounds(plain),
        "gpt_overlap": ep_overlap.merge_rounds(overlap),
    }
    assert results["gpt_plain"]["round_medians_s"] == [1.2, 1.0]
    assert results["gpt_plain"]["peak_gib"] == 1.1
    assert ep_overlap.summarize(results)["gpt_overlap_speedup"] == pytest.approx(1.1)
    assert ep_overlap.summarize(results)["grouped_overlap_speedup"] is None
    assert ep_overlap.round_ratios(results) == {"gpt_overlap_speedup": pytest.approx([1.2, 1.0])}


def test_sync_sites_names_the_package_frame_and_restores_the_mode(tools, monkeypatch):
    """Warnings of torch's sync debug mode are counted by the innermost package frame (with
    ours after a megatron-core one); other warnings are not counted; the mode is put back."""
    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    source = (
        "import warnings\n"
        "def sync(message='called a synchronizing CUDA operation'):\n"
        "    warnings.warn(message)\n"
    )
    core, ours = {}, {}
    exec(compile(source, "/x/megatron/core/moe/dispatch.py", "exec"), core)
    exec(compile("def dispatch(core):\n    core()\n", "/x/megatron_hybrid/moe.py", "exec"), ours)

    def call():
        for _ in range(3):
            ours["dispatch"](core["sync"])
        core["sync"]()
        core["sync"]("not about synchronisation")

    sites = tools[0].sync_sites(call)
    assert sites == [
        {"site": "megatron/core/moe/dispatch.py:3 (from megatron_hybrid/moe.py:2)", "count": 3},
        {"site": "megatron/core/moe/dispatch.py:3", "count": 1},
    ]
    assert modes == ["warn", "default"]


@pytest.mark.parametrize(
    "content", [None, "not json", '{"traceEvents": []}'], ids=["missing", "not-json", "no-kernels"]
)
def test_trace_summary_command_rejects_bad_traces_with_exit_2(tools, tmp_path, monkeypatch, capsys,
                                                               content):  # fmt: skip
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(sys, "argv", ["trace_summary.py", str(path)])
    with pytest.raises(SystemExit) as exit_info:
        tools[0].main()
    assert exit_info.value.code == 2
    assert str(path) in capsys.readouterr().err


@pytest.fixture(scope="module")
def host_overhead():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("host_overhead")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _node_grads(module, mode):
    import torch

    torch.manual_seed(0)
    nodes = torch.nn.ModuleList(
        torch.nn.Sequential(*(module.Block(8) for _ in range(2))) for _ in range(3)
    )
    inputs = [torch.randn(4, 8) for _ in range(3)]
    module.RUNNERS[mode](nodes, inputs)
    return {name: p.grad.clone() for name, p in nodes.named_parameters()}


@pytest.mark.parametrize("mode", ["split", "interleaved"], ids=["split", "interleaved"])
def test_host_overhead_modes_do_the_same_work(host_overhead, mode):
    """Every mode runs every node's forward and backward once per micro-batch: same gradients."""
    import torch

    reference = _node_grads(host_overhead, "phased")
    grads = _node_grads(host_overhead, mode)
    assert grads.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _host_args(**changes):
    import argparse

    sizes = dict(out="unused", nodes=1, blocks=1, microbatches=1, hidden=4, tokens=2, repeats=1)
    return argparse.Namespace(**{**sizes, "pin": 0, **changes})


def _host_rows(pin, ms):
    return [dict(mode="phased", pinned_cores=pin, step_ms=ms, per_block_us=ms)]


def test_host_overhead_results_replace_rows_of_the_same_pinning(host_overhead, tmp_path):
    host_overhead.write_results(tmp_path, "cpu", _host_args(pin=0), _host_rows(0, 1.0))
    host_overhead.write_results(tmp_path, "cpu", _host_args(pin=1), _host_rows(1, 2.0))
    host_overhead.write_results(tmp_path, "cpu", _host_args(pin=0), _host_rows(0, 3.0))
    saved = json.loads((tmp_path / "host_overhead_cpu.json").read_text())
    assert [(r["pinned_cores"], r["step_ms"]) for r in saved["rows"]] == [(0, 3.0), (1, 2.0)]
    assert sorted(saved["meta"]["commands"]) == ["0", "1"]
    assert not any("--out" in c for c in saved["meta"]["commands"].values())
    assert "| phased | 1 | 2.00 |" in (tmp_path / "host_overhead_cpu.md").read_text()


def test_host_overhead_refuses_to_mix_sizes(host_overhead, tmp_path):
    host_overhead.write_results(tmp_path, "cpu", _host_args(), _host_rows(0, 1.0))
    with pytest.raises(ValueError, match="measured with .*'hidden': 4.*use another --out"):
        host_overhead.write_results(tmp_path, "cpu", _host_args(hidden=8), _host_rows(0, 1.0))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pin", "100000"], "--pin 100000: only .* cores are available here"),
        (["--pin", "-1"], "--pin must be 0 or more"),
        (["--nodes", "0"], "--nodes must be at least 1"),
    ],
    ids=["too-many-cores", "negative-pin", "no-nodes"],
)
def test_host_overhead_bad_arguments_exit_2(host_overhead, monkeypatch, capsys, argv, message):
    import re

    monkeypatch.setattr(sys, "argv", ["host_overhead.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        host_overhead.main()
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_bind_cores_takes_this_ranks_block(tools, monkeypatch):
    import argparse

    ep_overlap = tools[1]
    bound = {}
    monkeypatch.setattr(ep_overlap.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(
        ep_overlap.os, "sched_setaffinity", lambda pid, cores: bound.update(c=cores)
    )
    monkeypatch.setattr(ep_overlap.torch, "set_num_threads", lambda n: None)
    parser = argparse.ArgumentParser()
    assert ep_overlap.bind_cores(1, 3, parser) == [3, 4, 5] == bound["c"]


def test_bind_cores_refuses_more_cores_than_there_are(tools, monkeypatch, capsys):
    import argparse

    ep_overlap = tools[1]
    monkeypatch.setattr(ep_overlap.os, "sched_getaffinity", lambda pid: set(range(8)))
    with pytest.raises(SystemExit) as exit_info:
        ep_overlap.bind_cores(2, 3, argparse.ArgumentParser())
    assert exit_info.value.code == 2
    assert "rank 2 needs cores 6..8 of the 8 allowed here" in capsys.readouterr().err


@pytest.mark.slow
def test_prepare_data_benchmark_records_its_run(tmp_path):
    """benchmarks/prepare_data.py end to end on a tiny corpus: the record names machine, date
    and command, and every case's ratio is its time over the floor's."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        bench = importlib.import_module("prepare_data")
        bench.main(["--documents", "60", "--repeats", "1", "--vocab-size", "400",
                    "--out", str(tmp_path)])  # fmt: skip
    finally:
        sys.path.remove(str(BENCHMARKS))
    record = json.loads((tmp_path / "prepare_data_CPU.json").read_text())
    assert record["command"] == (
        "python benchmarks/prepare_data.py --documents 60 --repeats 1 --vocab-size 400 "
        "--out benchmarks/results"
    )
    assert record["machine"] and record["date"]
    assert len(record["results"]) == 4
    for case in record["results"].values():
        assert case["ratio"] == pytest.approx(case["prepare_data_seconds"] / case["floor_seconds"])
    assert "| text (--workers 1) |" in (tmp_path / "prepare_data_CPU.md").read_text()

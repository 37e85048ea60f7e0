"""``benchmarks/mfu.py`` (train's step) on the CPU, tiny shape, and its kernel breakdown on a
synthetic trace."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def _env():
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS.parent), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
def test_tiny_run_of_trains_step(tmp_path):
    """train's step on the CPU (every sequence 64 long, so the FLOPs have a hand count), the MFU
    against a peak from the environment, the phases adding up to their step."""
    runs = ["star_e/fast", "ge/fast", "star_e/reference", "star_e/te"]
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "mfu.py"), "--shape", "tiny", "--warmup", "1",
         "--steps", "1", "--data", "full", "--out", str(tmp_path), "--host-profile", "3",
         "--runs", *runs],
        capture_output=True, text=True, timeout=600,
        env={**_env(), "MEGATRON_HYBRID_PEAK_TFLOPS": "0.5"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped (TransformerEngine not importable): star_e/te" in result.stdout
    steps = [line for line in result.stdout.splitlines() if line.startswith("   steps s: ")]
    assert len(steps) == 3 and all(len(line.split(",")) == 1 for line in steps)  # one step each
    data = json.loads((tmp_path / "mfu_tiny_CPU_full.json").read_text())
    assert list(data["results"]) == ["star_e/fast", "ge/fast", "star_e/reference"]
    assert data["meta"]["peak_tflops"] == 0.5
    fast = data["results"]["star_e/fast"]
    # 2 logical layers [*E], 2 micro-batches of 64 tokens, vocab 256, SwiGLU experts (top-2 of
    # hidden 32): the same count model_flops gives, times three for the step.
    tokens, h = 128, 64
    attention = 2 * tokens * h * 3 * h + 2 * (2 * 64 * 65 // 2) * h * 2 + 2 * tokens * h * h
    moe = 2 * tokens * h * 8 + 2 * (2 * tokens * h * 64 + 2 * tokens * 32 * h)
    forward = 2 * (attention + moe) + 2 * tokens * h * 256
    assert fast["step_tflop"] * 1e12 == pytest.approx(3 * forward)
    assert fast["tflops_per_gpu"] == pytest.approx(fast["step_tflop"] / fast["median_s"])
    assert fast["mfu"] == pytest.approx(fast["tflops_per_gpu"] / 0.5)
    assert fast["tokens_per_s"] == pytest.approx(tokens / fast["median_s"])
    assert fast["fast_path"] and all(line.endswith(": fast") for line in fast["fast_path"])
    assert "fast_path" not in data["results"]["star_e/reference"]
    for run in data["results"].values():
        phases = run["phases_ms"]
        assert list(phases) == ["data", "forward-backward", "gradient finalisation", "guard",
                                "optimizer", "host"]  # fmt: skip
        assert sum(phases.values()) == pytest.approx(run["phases_step_ms"], rel=1e-9)
    table = (tmp_path / "mfu_tiny_CPU_full.md").read_text()
    assert "| star_e/fast |" in table and "| star_e MFU >= 0.30 (fast) |" in table
    assert "| run | data | forward-backward | gradient finalisation | guard |" in table
    host = fast["host_profile"]
    assert len(host["top"]) == 3 and host["function_calls"] > 1000
    assert [f["own_ms"] for f in host["top"]] == sorted((f["own_ms"] for f in host["top"]),
                                                        reverse=True)  # fmt: skip
    assert "| function | calls | own ms | cumulative ms |" in table


@pytest.mark.slow
def test_each_rank_reports_its_own_steps_at_ep2(tmp_path):
    """Two gloo ranks at EP 2: the run's figures are rank 0's, and every rank's own timed steps,
    phases and experts' rows come back beside them (gathered, not copied from rank 0), with
    the profiled figures a GPU run adds left empty on the CPU."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(BENCHMARKS / "mfu.py"), "--shape", "tiny", "--warmup", "1", "--steps", "2",
         "--data", "full", "--ep", "2", "--out", str(tmp_path), "--runs", "star_e/fast"],
        capture_output=True, text=True, timeout=600, env=_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads((tmp_path / "mfu_tiny_CPU_2gpu_full.json").read_text())["results"]
    ranks = run["star_e/fast"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["steps_s"] == run["star_e/fast"]["steps_s"]
    assert ranks[0]["phases_ms"] == run["star_e/fast"]["phases_ms"]
    assert ranks[1]["phases_ms"] != ranks[0]["phases_ms"]  # measured on rank 1, not copied
    assert all(len(r["steps_s"]) == 2 and r["cpu_sync_wait_ms"] is None for r in ranks)
    # The experts' rows of the phase-timed step: each rank's 2 micro-batches of 64 tokens, top-2,
    # in 2 MoE layers, wherever the all-to-alls took them.
    assert sum(r["expert_rows"] for r in ranks) == 2 * (2 * 64 * 2 * 2)
    table = (tmp_path / "mfu_tiny_CPU_2gpu_full.md").read_text()
    rows = table.split("| run | rank | median step s | slowest step s |")[1].split("\n\n")[0]
    assert [line.split(" | ")[1] for line in rows.splitlines()[2:]] == ["0", "1"]
    # Each rank's timed steps with what else each did, a column per rank.
    assert all(len(r["step_events"]) == 2 and r["step_events"][0]["cuda_mallocs"] is None
               for r in ranks)  # fmt: skip
    steps = table.split("| run | step | rank 0 | rank 1 |")[1].split("\n\n")[0]
    cells = [line.split(" | ")[2:] for line in steps.strip().splitlines()[1:]]
    assert [cell[0].split(" s: ")[0] for cell in cells] == [f"{t:.3f}" for t in ranks[0]["steps_s"]]
    assert [cell[1].split(" s: ")[0] for cell in cells] == [f"{t:.3f}" for t in ranks[1]["steps_s"]]


def test_runs_are_checked_before_any_work(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "mfu.py"), "--out", str(tmp_path), "--runs",
         "ge/gpt-te"], capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert result.returncode == 2
    assert "--runs 'ge/gpt-te': expected PATTERN/IMPL" in result.stderr
    assert not list(tmp_path.iterdir())


def _event(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_kernel_breakdown():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        trace_summary = importlib.import_module("trace_summary")
    finally:
        sys.path.remove(str(BENCHMARKS))
    events = [
        _event("mh_step", "user_annotation", 0, 100),
        _event("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "kernel", 1, 20),
        _event("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "kernel", 30, 20),
        _event(
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "kernel", 60, 10
        ),
        _event("void at::native::vectorized_elementwise_kernel<4, ...>", "kernel", 75, 4),
        _event("triton_poi_fused_mul_silu_0", "kernel", 80, 3),
        _event("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "kernel", 85, 5),
        _event("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 91, 1),
        _event("outside the step", "kernel", 200, 50),
    ]
    breakdown = trace_summary.kernel_breakdown(events, top=2)
    categories = breakdown["categories"]
    assert list(categories) == ["gemm", "attention", "triton", "elementwise", "memory"]
    assert categories["gemm"] == {"ms": 0.04, "count": 2}
    assert categories["triton"]["count"] == 2  # inductor's and fla's kernels
    assert [k["category"] for k in breakdown["kernels"]] == ["gemm", "attention"]
    assert breakdown["kernels"][0]["mean_us"] == 20


@pytest.mark.parametrize(
    ("flag", "field", "given", "stem"),
    [
        pytest.param("--manual-gc", "manual_gc", True, "_manualgc", id="manual-gc"),
        pytest.param("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", False,
                     "_nowgradfusion", id="no-wgrad-fusion"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("on", [True, False], ids=["given", "default"])
def test_train_flags_reach_trains_settings(monkeypatch, flag, field, given, stem, on):
    """``mfu.py --manual-gc`` / ``--no-gradient-accumulation-fusion`` give ``train`` its flag
    (for ``--manual-gc`` the benchmark then wraps the steps in the same collector) and name it in
    the results' file; without it neither."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(BENCHMARKS))
    try:
        mfu = importlib.import_module("mfu")
    finally:
        sys.path.remove(str(BENCHMARKS))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    args = mfu.build_parser().parse_args(["--quick"] + ([flag] if on else []))
    flags = mfu.train_flags(SimpleNamespace(**mfu.SHAPES["tiny"]), "star_e", "fast", args)
    assert (flag in flags) is on
    assert getattr(mfu.train_args(flags), field) is (given if on else not given)
    assert mfu.result_stem(args, "tiny", "CPU").endswith(stem) is on


def _module(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("data", ["documents", "variable"], ids=["documents", "default"])
def test_documents_data_reaches_trains_settings(monkeypatch, data):
    """``mfu.py --data documents`` runs ``train --synthetic-samples documents`` and names it in
    the results' file; the default data keeps train's default samples."""
    from types import SimpleNamespace

    import torch

    mfu = _module("mfu")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    args = mfu.build_parser().parse_args(["--quick", "--packed", "--data", data])
    flags = mfu.train_flags(SimpleNamespace(**mfu.SHAPES["tiny"]), "star_e", "fast", args)
    expected = "documents" if data == "documents" else "sequence"
    assert mfu.train_args(flags).synthetic_samples == expected
    assert mfu.result_stem(args, "tiny", "CPU").endswith(
        "_documents_packed" if data == "documents" else "CPU_packed"
    )


def test_host_profile_names_where_the_time_goes():
    """The function that spends the time heads the list, by its own time; the caller that only
    waits on it does not (control: its cumulative time is as large)."""
    import time

    common = _module("common")

    def slow():
        time.sleep(0.05)

    def caller():
        for _ in range(3):
            slow()
        sum(range(1000))

    profile = common.host_profile(caller, 1)
    (first,) = profile["top"]
    assert "sleep" in first["function"] and first["calls"] == 3 and first["own_ms"] >= 150
    assert profile["step_ms"] >= first["own_ms"]
    stats = {f["function"]: f for f in common.host_profile(caller, 50)["top"]}
    waiting = next(f for name, f in stats.items() if name.endswith("(caller)"))
    assert waiting["cumulative_ms"] >= 150 > waiting["own_ms"]


def test_targets_take_the_faster_of_train_s_default_and_its_graphs():
    """A target's figure is the better measured of ``fast`` and ``fast-graphs`` (both are
    ``train``'s step: its default and ``--hybrid-cuda-graphs``), and says which; unmeasured
    targets say so."""
    mfu = _module("mfu")
    results = {"ge/fast": {"mfu": 0.109}, "ge/fast-graphs": {"mfu": 0.216},
               "star_e/fast": {"mfu": 0.23}, "plus_e/fast-graphs": {"mfu": 0.21}}  # fmt: skip
    rows = {label.split()[0]: (label, value) for label, value, _ in mfu.target_rows(results)}
    assert rows["ge"] == ("ge MFU >= 0.20 (fast-graphs)", 0.216)
    assert rows["star_e"] == ("star_e MFU >= 0.30 (fast)", 0.23)
    assert rows["plus_e"] == ("plus_e MFU >= 0.20 (fast-graphs)", 0.21)
    assert rows["me"] == ("me MFU >= 0.20 (fast or fast-graphs)", None)
    assert [mfu._met(v, b) for _, v, b in mfu.target_rows(results)] == [
        "**not met**", "met", "not measured", "met"
    ]  # fmt: skip

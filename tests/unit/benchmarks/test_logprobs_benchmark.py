"""``benchmarks/logprobs.py`` on the CPU (``--tiny``, float32) and its routing-flip report.

In float32 on a CPU packed and padded runs route every token alike (their log-probs agree to
1e-6), so the report must count no flip; on made-up expert choices with one flip it must find
the flip and put the differences after it downstream.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from routing_flips import flip_report  # noqa: E402


def test_a_flip_and_what_lies_downstream_of_it():
    k, layers = 2, 3
    a = {0: torch.zeros(layers, 6, k, dtype=torch.int16), 1: torch.ones(layers, 4, k).short()}
    b = {i: t.clone() for i, t in a.items()}
    b[0][1, 3] = torch.tensor([5, 7])  # layer 1, position 3 of sequence 0 routes elsewhere
    differences = [torch.tensor([1e-6, 2e-6, 1e-6, 0.3, 0.1, 0.2]), torch.full((4,), 1e-6)]
    report = flip_report(a, b, differences)
    assert report["flips_per_layer"] == [0, 1, 0]
    assert (report["tokens"], report["tokens_with_flip"]) == (10, 1)
    assert report["downstream_tokens"] == 3  # positions 3, 4, 5 of sequence 0
    assert report["max_downstream"] == pytest.approx(0.3)
    assert report["max_elsewhere"] == pytest.approx(2e-6)
    assert report["downstream_share"] > 0.99
    # Control: the same runs without the flip put nothing downstream.
    clean = flip_report(a, a, differences)
    assert clean["tokens_with_flip"] == clean["downstream_tokens"] == 0
    assert clean["max_elsewhere"] == pytest.approx(0.3)


@pytest.mark.slow
def test_tiny_run_counts_no_flip_in_float32(model_parallel, tmp_path):
    import logprobs as benchmark

    argv = ["--tiny", "--layers", "4", "--tokens", "120", "--min-len", "12", "--max-len", "30",
            "--max-tokens", "64", "--repeats", "1", "--out", str(tmp_path)]  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a thread pool only adds synchronisation
    try:
        benchmark.main(argv)
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "logprobs_CPU.json").read_text())
    flips = data["meta"]["routing_flips"]
    assert data["meta"]["max_abs_diff"] < 1e-4
    # Every input token of every sequence (all but its last), matched in both runs.
    assert flips["tokens"] == data["meta"]["tokens"] - data["meta"]["sequences"]
    assert flips["tokens_with_flip"] == 0 and flips["flips_per_layer"] == [0] * 4
    assert "routing flips" in (tmp_path / "logprobs_CPU.md").read_text()
    assert data["meta"]["command"].startswith("python benchmarks/logprobs.py --tiny")


def test_profile_lines_name_the_costliest_kernels_and_host_operators():
    import logprobs as benchmark

    summary = dict(window_ms=700.0, gpu_busy_ms=210.0, gpu_idle_ms=490.0, cpu_op_busy_ms=650.0,
                   cpu_ops=12000, cpu_sync_wait_ms=30.0, compute_kernels=4100)  # fmt: skip
    kernels = {
        "categories": {"gemm": {"ms": 120.0, "count": 300}, "triton": {"ms": 90.0, "count": 800}},
        "kernels": [{"name": "sm90_xmma_gemm_bf16", "category": "gemm", "ms": 100.0,
                     "count": 200, "mean_us": 500.0}],  # fmt: skip
    }
    host = [{"name": "aten::item", "self_cpu_ms": 40.0, "count": 64}]
    syncs = [{"site": "megatron/core/ssm/gated_delta_net/common.py:457", "count": 108}]
    modules = [{"module": "GroupedGemmExperts", "self_ms": 86.1, "calls": 72}]
    operators = [{"module": "FastGatedDeltaNet", "ops": 2655}]
    sites = [{"op": "aten.repeat_interleave.Tensor", "site": "padding/batch.py:414 on cpu",
              "count": 9}]  # fmt: skip
    row = dict(layout="packed",
               profile=dict(summary=summary, kernels=kernels, host=host, syncs=syncs,
                            hooked_ms=451.0, modules=modules, operators=operators,
                            op_sites=sites))  # fmt: skip
    text = "\n".join(benchmark._profile_lines(row))
    assert "profiled packed call: 700 ms, GPU busy 210 ms, idle 490 ms" in text
    assert "| gemm | 120.0 | 300 |" in text and "| triton | 90.0 | 800 |" in text
    assert "| `sm90_xmma_gemm_bf16` | gemm | 100.0 | 200 | 500 |" in text
    assert "| `aten::item` | 40.0 | 64 |" in text
    assert "| `megatron/core/ssm/gated_delta_net/common.py:457` | 108 |" in text
    assert "one more call under hooks, 451 ms" in text
    assert "| GroupedGemmExperts | 86.1 | 72 |" in text and "| FastGatedDeltaNet | 2655 |" in text
    assert "| `aten.repeat_interleave.Tensor` | `padding/batch.py:414 on cpu` | 9 |" in text

"""``benchmarks/op_count.py``: which profiled operators count as kernels, and a whole run."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def op_count():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("op_count")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _profile(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return prof.events()


def test_views_do_not_count_and_composites_count_their_kernels(op_count):
    x = torch.randn(8, 6)

    def work():
        y = x.t().contiguous()  # a view, then one copy
        z = y.view(-1) + 1.0  # a view, then one add (the scalar's host copy is no kernel)
        return torch.nn.functional.linear(z.view(6, 8), torch.randn(4, 8))  # randn + mm (+ ...)

    counts = op_count.kernel_ops(_profile(work))
    assert counts["aten::copy_"] == 1 and counts["aten::add"] == 1
    assert not set(counts) & op_count.NO_KERNEL
    assert "aten::linear" not in counts and "aten::contiguous" not in counts  # composites


def test_one_kernel_operators_hide_their_loops(op_count):
    """``torch._grouped_mm`` loops over its groups with ``mm`` on the CPU: one kernel on a GPU."""
    a, b = torch.randn(12, 8), torch.randn(3, 8, 4)
    offsets = torch.tensor([4, 8, 12], dtype=torch.int32)
    counts = op_count.kernel_ops(_profile(lambda: torch._grouped_mm(a, b, offs=offsets)))
    assert counts["aten::_grouped_mm"] == 1 and "aten::mm" not in counts


@pytest.mark.slow
def test_star_e_run_writes_counts(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "op_count.py"), "--patterns", "star_e",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "op_count_fast.json").read_text())["star_e"]
    top = dict(result["top"])
    # Six grouped GEMMs per MoE layer (two forward, four backward) and two grouped weight-
    # gradient adds; no per-expert loop anywhere (64 experts would show as hundreds).
    assert top["aten::_grouped_mm"] == 6
    assert 50 < result["per_layer"] < 200

"""``benchmarks/mamba_torch.py`` where megatron-core's Mamba kernels cannot run (this CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.mark.slow
def test_measures_torch_path_then_exits_2_without_kernels(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS.parent), env.get("PYTHONPATH", "")])
    tiny = ["--hidden", "64", "--head-dim", "16", "--state", "8", "--groups", "2", "--seq", "40"]
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "mamba_torch.py"), *tiny, "--steps", "1",
         "--warmup", "0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "measured the torch path only" in result.stderr
    assert "mamba_ssm is not importable" in result.stderr
    table = (tmp_path / "mamba_torch_cpu.md").read_text()
    assert "| 40 | torch |" in table and "| kernels |" not in table

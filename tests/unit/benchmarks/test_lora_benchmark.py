"""``benchmarks/lora.py`` on the CPU with its tiny presets: every measurement runs and the
results files say what the GPU run will."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.mark.slow
def test_tiny_run_writes_every_measurement(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS.parent), env.get("PYTHONPATH", "")])
    argv = ["--preset", "tiny", "--sync-preset", "tiny", "--device", "cpu", "--seq-length", "32",
            "--steps", "1", "--repeats", "1", "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run([sys.executable, str(BENCHMARKS / "lora.py"), *argv],
                            capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "lora_CPU.json").read_text())
    full, lora = data["full"], data["lora"]
    assert lora["trainable"] < full["trainable"] == full["parameters"]
    assert lora["parameters"] > full["parameters"]  # the adapters come on top of the base
    assert lora["adapter"]["tensors"] == 78 and lora["merged"]["bytes"] == lora["plain"]["bytes"]
    assert data["sync"]["tensors"] == 78 and data["sync"]["seconds_median"] > 0
    assert "| LoRA |" in (tmp_path / "lora_CPU.md").read_text()

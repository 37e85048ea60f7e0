"""The README's Python API block runs as written (in a fresh process, on the CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_model_snippet_runs():
    blocks = [b for b in _python_blocks() if "HybridModel(" in b]
    assert len(blocks) == 1
    code = blocks[0] + "\nassert logits.shape == (2, 16, 32000), logits.shape\nprint('ok')\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=240, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_moe_with_bias_is_refused_at_build_time(pg):
    """With biases a MoE model fails in its first forward; it must fail when built instead."""
    from megatron_hybrid.testing.models import build_hybrid, small_config

    with pytest.raises(ValueError, match=r"cannot have biases: set add_bias_linear=False"):
        build_hybrid(small_config("[*E]{2}", add_bias_linear=True), "[*E]{2}", pg)

"""``python -m megatron_hybrid train``: bad input exits 2 with a clear message, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_cli(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m megatron_hybrid train ARGV`` in a fresh process (CPU, one thread)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_hybrid", "train", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(
            ["--hybrid-layer-pattern", "[*E]{2", "--num-experts", "4"],
            ["train: error: '{' at position 4 is never closed", "  pattern: '[*E]{2'",
             "                ^"],
            id="bad_pattern_caret",
        ),
        pytest.param(
            ["--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "4", "--bogus-flag", "3"],
            ["error: unrecognized arguments: --bogus-flag 3"],
            id="unknown_flag",
        ),
        pytest.param(
            ["--hybrid-layer-pattern", "[*E]{2}"],
            ["train: error: the pattern '[*E]{2}' has MoE ('E') layers; set --num-experts"],
            id="moe_without_num_experts",
        ),
    ],
)  # fmt: skip
def test_bad_input_exits_2(argv, expected):
    result = run_cli(*argv)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    for line in expected:
        assert any(line in got for got in lines), f"{line!r} not in:\n{result.stderr}"
    # One error line (the caret block belongs to it); nothing trained, nothing printed to stdout.
    assert sum("error:" in line for line in lines) == 1, result.stderr
    assert result.stdout == ""
